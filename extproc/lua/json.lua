-- JSON for the gateway's Lua filters (LuaJIT in Envoy, which ships no JSON library): a checker and a
-- decoder. The renderer (llmgw/render/filters.py) puts this before each script that reads JSON, so
-- its locals are theirs.

local byte, sub, tonumber = string.byte, string.sub, tonumber
local MAX_DEPTH = 64

-- A JSON checker written for LuaJIT's compiler: byte comparisons only (string patterns are not
-- compiled, and a checker built on them cost ~4 us per event against ~0.5 us for this one).
local function skip(s, i)  -- past whitespace: the index and the byte there
  local c = byte(s, i)
  while c == 32 or c == 10 or c == 13 or c == 9 do
    i = i + 1
    c = byte(s, i)
  end
  return i, c
end

local function is_hex(c)
  return c ~= nil and ((c >= 48 and c <= 57) or (c >= 65 and c <= 70) or (c >= 97 and c <= 102))
end

local function json_string(s, i)  -- s[i] is the opening quote; the index after the closing one
  i = i + 1
  while true do
    local c = byte(s, i)
    if c == nil or c < 32 then return nil end  -- unterminated, or a raw control character
    if c == 34 then return i + 1 end
    if c == 92 then
      local e = byte(s, i + 1)
      if e == 117 then
        if not (is_hex(byte(s, i + 2)) and is_hex(byte(s, i + 3)) and is_hex(byte(s, i + 4))
                and is_hex(byte(s, i + 5))) then return nil end
        i = i + 6
      elseif e == 34 or e == 92 or e == 47 or e == 98 or e == 102 or e == 110 or e == 114 or e == 116 then
        i = i + 2
      else
        return nil
      end
    else
      i = i + 1
    end
  end
end

local function digits(s, i)
  local c = byte(s, i)
  while c ~= nil and c >= 48 and c <= 57 do
    i = i + 1
    c = byte(s, i)
  end
  return i
end

local function number(s, i)
  if byte(s, i) == 45 then i = i + 1 end  -- -
  local c = byte(s, i)
  if c == 48 then
    i = i + 1
  elseif c ~= nil and c >= 49 and c <= 57 then
    i = digits(s, i + 1)
  else
    return nil
  end
  if byte(s, i) == 46 then  -- .
    local j = digits(s, i + 1)
    if j == i + 1 then return nil end
    i = j
  end
  c = byte(s, i)
  if c == 101 or c == 69 then  -- e E
    i = i + 1
    c = byte(s, i)
    if c == 43 or c == 45 then i = i + 1 end
    local j = digits(s, i)
    if j == i then return nil end
    i = j
  end
  return i
end

local function literal(s, i, word)
  return sub(s, i, i + #word - 1) == word and i + #word or nil
end

-- A decoded JSON value: objects and arrays as tables, numbers as numbers, true and false, JSON's null
-- as NULL, and strings as their text between the quotes *still escaped* - what a filter copies into
-- JSON it writes stays exactly as the upstream wrote it, and is never unescaped and escaped again.
-- SPAN holds, for each decoded object and array, where its text lies in the input (start, end) and,
-- for an array, `true` third.
local NULL = setmetatable({}, {__tostring = function() return "null" end})
local SPAN = setmetatable({}, {__mode = "k"})

local decode
decode = function(s, i, depth)  -- the value at (or after whitespace from) i and the index after it
  if depth > MAX_DEPTH then return nil end
  local c
  i, c = skip(s, i)
  local from = i
  if c == 123 then  -- {
    local obj = {}
    i, c = skip(s, i + 1)
    if c ~= 125 then
      while true do
        if c ~= 34 then return nil end
        local after = json_string(s, i)
        if after == nil then return nil end
        local name = sub(s, i + 1, after - 2)
        i, c = skip(s, after)
        if c ~= 58 then return nil end  -- :
        local v
        v, i = decode(s, i + 1, depth + 1)
        if i == nil then return nil end
        obj[name] = v
        i, c = skip(s, i)
        if c == 125 then break end
        if c ~= 44 then return nil end  -- ,
        i, c = skip(s, i + 1)
      end
    end
    SPAN[obj] = {from, i}
    return obj, i + 1
  elseif c == 91 then  -- [
    local arr, n = {}, 0
    i, c = skip(s, i + 1)
    if c ~= 93 then
      while true do
        local v
        v, i = decode(s, i, depth + 1)
        if i == nil then return nil end
        n = n + 1
        arr[n] = v
        i, c = skip(s, i)
        if c == 93 then break end
        if c ~= 44 then return nil end
        i = i + 1
      end
    end
    SPAN[arr] = {from, i, true}
    return arr, i + 1
  elseif c == 34 then
    local after = json_string(s, i)
    if after == nil then return nil end
    return sub(s, i + 1, after - 2), after
  elseif c == 116 then
    local after = literal(s, i, "true")
    if after == nil then return nil end
    return true, after
  elseif c == 102 then
    local after = literal(s, i, "false")
    if after == nil then return nil end
    return false, after
  elseif c == 110 then
    local after = literal(s, i, "null")
    if after == nil then return nil end
    return NULL, after
  end
  local after = number(s, i)
  if after == nil then return nil end
  return tonumber(sub(s, i, after - 1)), after
end

-- The whole text s as one JSON value (nothing but whitespace after it), or nil.
local function decode_all(s)
  local v, after = decode(s, 1, 0)
  if after == nil or skip(s, after) <= #s then return nil end
  return v
end
