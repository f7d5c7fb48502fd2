
-- AWS's event-stream framing (Bedrock's ConverseStream), for the Lua answer filter: binary messages,
-- each a prelude (total length, headers length, both big-endian 32-bit, then the CRC-32 of those 8
-- bytes), headers (name length, name, value type, value), the payload and the CRC-32 of everything
-- before it. botocore's parser (extproc/shapes/bedrock/adapter.py) reads it the same way; the renderer puts
-- this after extproc/lua/json.lua and sse.lua.

local bit = require("bit")
local band, bxor, rshift, bnot, tobit = bit.band, bit.bxor, bit.rshift, bit.bnot, bit.tobit

local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do c = band(c, 1) == 1 and bxor(rshift(c, 1), 0xEDB88320) or rshift(c, 1) end
  CRC_TABLE[i] = c
end

local function crc32(s, from, to)  -- as a signed 32-bit number, as LuaJIT's bit operations give it
  local c = bnot(0)
  for i = from, to do c = bxor(rshift(c, 8), CRC_TABLE[band(bxor(c, byte(s, i)), 0xFF)]) end
  return bnot(c)
end

local function u32(s, i)
  local a, b, c, d = byte(s, i, i + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

-- Bytes each header value type takes after its type byte (6: bytes and 7: string say their length).
local VALUE_BYTES = {[0] = 0, [1] = 0, [2] = 1, [3] = 2, [4] = 4, [5] = 8, [8] = 8, [9] = 16}

-- The message of buf that starts at `at` (1 when absent): its string headers, its payload and its
-- length; nil while it is not all here; false when the framing is broken (a bad length or CRC, an
-- unknown value type, a message over `max` bytes).
local function eventstream_message(buf, max, at)
  local o = (at or 1) - 1  -- every index below is the message's own, shifted by o
  if #buf - o < 12 then return nil end
  local total, hlen = u32(buf, o + 1), u32(buf, o + 5)
  if total < 16 or total > max or hlen > total - 16 or crc32(buf, o + 1, o + 8) ~= tobit(u32(buf, o + 9)) then
    return false
  end
  if #buf - o < total then return nil end
  if crc32(buf, o + 1, o + total - 4) ~= tobit(u32(buf, o + total - 3)) then return false end
  local headers, i, last = {}, o + 13, o + 12 + hlen
  while i <= last do
    local name_end = i + byte(buf, i)
    local kind = byte(buf, name_end + 1)
    if kind == nil or name_end + 1 > last then return false end
    local name, value_at = sub(buf, i + 1, name_end), name_end + 2
    if kind == 6 or kind == 7 then
      if value_at + 1 > last then return false end
      local length = byte(buf, value_at) * 256 + byte(buf, value_at + 1)
      if kind == 7 then headers[name] = sub(buf, value_at + 2, value_at + 1 + length) end
      i = value_at + 2 + length
    elseif VALUE_BYTES[kind] ~= nil then
      i = value_at + VALUE_BYTES[kind]
    else
      return false
    end
    if i > last + 1 then return false end
  end
  return headers, sub(buf, last + 1, o + total - 4), total
end
