
-- Decoded JSON values (extproc/lua/json.lua's decoder) as the Lua filters that translate read them; the
-- renderer puts this after json.lua.

local floor, gsub, format, char, find, concat = math.floor, string.gsub, string.format, string.char, string.find,
  table.concat

-- JSON text as the content of a JSON string (a tool call's arguments).
local ESCAPES = {['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t"}
local function as_string(text)
  return (gsub(text, '[%c"\\]', function(c) return ESCAPES[c] or format("\\u%04x", c:byte()) end))
end

-- The text a JSON string's content (as the decoder keeps it: still escaped) stands for, as UTF-8.
local UNESCAPES = {b = "\b", f = "\f", n = "\n", r = "\r", t = "\t"}
local function utf8(code)
  -- A surrogate left unpaired (`\ud800` alone) is no character: UTF-8 cannot hold it, and the text is
  -- passed on as UTF-8 (an answer, a reason, metadata). It becomes U+FFFD, as a decoder would read it.
  if code >= 0xD800 and code <= 0xDFFF then code = 0xFFFD end
  if code < 0x80 then return char(code) end
  if code < 0x800 then return char(0xC0 + floor(code / 64), 0x80 + code % 64) end
  if code < 0x10000 then
    return char(0xE0 + floor(code / 4096), 0x80 + floor(code / 64) % 64, 0x80 + code % 64)
  end
  return char(0xF0 + floor(code / 262144), 0x80 + floor(code / 4096) % 64, 0x80 + floor(code / 64) % 64,
              0x80 + code % 64)
end
local function unescape(text)
  if not find(text, "\\", 1, true) then return text end
  local out, i = {}, 1
  while true do
    local j = find(text, "\\", i, true)
    if j == nil then
      out[#out + 1] = sub(text, i)
      return concat(out)
    end
    out[#out + 1] = sub(text, i, j - 1)
    local e = sub(text, j + 1, j + 1)
    i = j + 2
    if e == "u" then
      local code = tonumber(sub(text, i, i + 3), 16)
      i = i + 4
      if code >= 0xD800 and code <= 0xDBFF and sub(text, i, i + 1) == "\\u" then  -- a surrogate pair
        local low = tonumber(sub(text, i + 2, i + 5), 16)
        if low >= 0xDC00 and low <= 0xDFFF then
          code, i = 0x10000 + (code - 0xD800) * 1024 + (low - 0xDC00), i + 6
        end
      end
      out[#out + 1] = utf8(code)
    else
      out[#out + 1] = UNESCAPES[e] or e  -- \" \\ \/ stand for themselves
    end
  end
end

local function is_object(v) local span = SPAN[v]; return span ~= nil and not span[3] end
local function is_array(v) local span = SPAN[v]; return span ~= nil and span[3] == true end
local function absent(v) return v == nil or v == NULL end

-- A token count as the Python adapters read it (extproc/shapes/base.py `token_count`: absent is 0);
-- nil for anything but a whole number from 0 to 2^53 (no provider counts otherwise; settlement would
-- charge it).
local function count(v)
  if absent(v) then return 0 end
  if type(v) ~= "number" or not (v >= 0 and v <= 9007199254740992) or v ~= floor(v) then return nil end
  return v
end

-- A string field: its (still escaped) text, `default` when absent; nil when it is not a string.
local function text_of(v, default)
  if absent(v) then return default end
  if type(v) ~= "string" then return nil end
  return v
end

local function list_of(v)  -- an array, {} when absent, nil when something else
  if absent(v) then return {} end
  if is_array(v) then return v end
  return nil
end

local function object_of(v)  -- an object, {} when absent, nil when something else
  if absent(v) then return {} end
  if is_object(v) then return v end
  return nil
end
