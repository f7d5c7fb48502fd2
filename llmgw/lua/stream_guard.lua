-- The stream guard, in Envoy (LuaJIT): every chunk of an admitted stream passes here, with no round
-- trip to ext_proc. The renderer (llmgw/envoy_render.py) prepends `CONFIG`: the metadata namespace,
-- the io.llmgw key names (extproc/names.py) and the contract's `stream_interrupted` events.
--
-- - Whole events only: the start of an event still arriving is held back until the rest comes.
-- - Each event's data is checked to be JSON (or [DONE]): a malformed event, an upstream error event,
--   an event over the size bound, or an end without [DONE] ends the client's stream with the contract's
--   `stream_interrupted` event; nothing after it reaches the client.
-- - The usage chunk the gateway asked for on the client's behalf is withheld from that client; its
--   numbers go into the request's metadata, where the access log carries them to settlement.
-- - The count of chunks that carried generated content is kept in the metadata as it grows, so a
--   stream Envoy cuts (client gone, reset, idle) settles from the access log with what was generated.
-- - Past the stream's end time (max_stream_ms, from its admission) the next chunk is replaced by the
--   `stream_interrupted` event; Envoy's own timer, set by ext_proc a little later, then resets the
--   exchange so the engine stops generating.

local find, sub, byte, concat = string.find, string.sub, string.byte, table.concat
local K, EVENT, MAX_EVENT, NS = CONFIG.keys, CONFIG.events, CONFIG.max_event_bytes, CONFIG.namespace
local MAX_DEPTH = 64

-- A minimal JSON checker: the index after the value that starts at (or after whitespace from) i, or
-- nil when the text there is not JSON. For the top-level object, `fields` gets each key's value span.
local value

local function skip(s, i)
  return find(s, "[^ \t\r\n]", i) or #s + 1
end

local function json_string(s, i)  -- s[i] is the opening quote
  i = i + 1
  while true do
    local j = find(s, '["\\%c]', i)
    if j == nil then return nil end
    local c = byte(s, j)
    if c == 34 then return j + 1 end  -- "
    if c ~= 92 then return nil end  -- a raw control character
    local e = byte(s, j + 1)
    if e == 117 then  -- \uXXXX
      if not find(s, "^%x%x%x%x", j + 2) then return nil end
      i = j + 6
    elseif e and find('"\\/bfnrt', string.char(e), 1, true) then
      i = j + 2
    else
      return nil
    end
  end
end

local function number(s, i)
  local _, e = find(s, "^-?%d+", i)
  if e == nil or (byte(s, i) == 48 and e > i) or (byte(s, i) == 45 and byte(s, i + 1) == 48 and e > i + 1) then
    return nil  -- no digits, or a leading zero
  end
  local _, f = find(s, "^%.%d+", e + 1)
  e = f or e
  _, f = find(s, "^[eE][-+]?%d+", e + 1)
  return (f or e) + 1
end

value = function(s, i, depth, fields)
  if depth > MAX_DEPTH then return nil end
  i = skip(s, i)
  local c = byte(s, i)
  if c == 123 then  -- {
    i = skip(s, i + 1)
    if byte(s, i) == 125 then return i + 1 end
    while true do
      if byte(s, i) ~= 34 then return nil end
      local after = json_string(s, i)
      if after == nil then return nil end
      local name = fields and sub(s, i + 1, after - 2)
      i = skip(s, after)
      if byte(s, i) ~= 58 then return nil end  -- :
      local from = skip(s, i + 1)
      i = value(s, from, depth + 1, nil)
      if i == nil then return nil end
      if fields then fields[name] = sub(s, from, i - 1) end
      i = skip(s, i)
      c = byte(s, i)
      if c == 125 then return i + 1 end
      if c ~= 44 then return nil end  -- ,
      i = skip(s, i + 1)
    end
  elseif c == 91 then  -- [
    i = skip(s, i + 1)
    if byte(s, i) == 93 then return i + 1 end
    while true do
      i = value(s, i, depth + 1, nil)
      if i == nil then return nil end
      i = skip(s, i)
      c = byte(s, i)
      if c == 93 then return i + 1 end
      if c ~= 44 then return nil end
      i = i + 1
    end
  elseif c == 34 then
    return json_string(s, i)
  elseif c == 116 then
    return find(s, "^true", i) and i + 4 or nil
  elseif c == 102 then
    return find(s, "^false", i) and i + 5 or nil
  elseif c == 110 then
    return find(s, "^null", i) and i + 4 or nil
  end
  return number(s, i)
end

-- The top-level fields of an event's JSON object, or nil when its data is not a JSON object.
local function object_fields(data)
  if byte(data, skip(data, 1)) ~= 123 then return nil end
  local fields = {}
  local e = value(data, 1, 0, fields)
  if e == nil or skip(data, e) <= #data then return nil end
  return fields
end

-- An event's data: its `data:` lines joined (nil for an event without any).
local function event_data(event)
  local parts = nil
  for line in string.gmatch(event, "[^\r\n]+") do
    if sub(line, 1, 5) == "data:" then
      local d = sub(line, 6)
      if byte(d, 1) == 32 then d = sub(d, 2) end
      parts = parts or {}
      parts[#parts + 1] = d
    end
  end
  return parts and concat(parts, "\n")
end

-- The end of the first complete event in buf (its blank line included), or nil.
local function event_end(buf)
  local best = nil
  for _, sep in ipairs({"\n\n", "\r\n\r\n", "\r\r"}) do
    local i, j = find(buf, sep, 1, true)
    if i and (best == nil or j < best) then best = j end
  end
  return best
end

local function content_chunk(choices)
  return find(choices, '"content"%s*:%s*"[^"]') or find(choices, '"tool_calls"%s*:%s*%[%s*{')
    or find(choices, '"reasoning[_%w]*"%s*:%s*"[^"]')
end

local function usage_number(usage, name)
  local _, _, n = find(usage, '"' .. name .. '"%s*:%s*(%d+)')
  return n and tonumber(n) or 0
end

local function metadata(h, key, v)
  h:streamInfo():dynamicMetadata():set(NS, key, v)
end

function envoy_on_response(h)
  local md = h:streamInfo():dynamicMetadata():get(NS)
  if md == nil or md[K.settle] ~= CONFIG.settle_stream then return end
  local status = tonumber(h:headers():get(":status")) or 0
  if status < 200 or status >= 300 then return end  -- an error status: already in the contract's shape
  local withhold = md[K.withhold_usage] == "1"
  local ends_at = tonumber(md[K.stream_ends_at_ms] or "")
  local pending, chunks, counted, ended, done = "", 0, 0, nil, false

  for chunk in h:bodyChunks() do
    local n = chunk:length()
    local at_end = n == 0  -- an HTTP/1 upstream's end of stream arrives as an empty last chunk
    local out = {}
    if ended == nil and ends_at ~= nil and h:timestamp() >= ends_at then
      ended = "over"
      out[1] = EVENT.over
    elseif ended == nil then
      if n > 0 then pending = pending .. chunk:getBytes(0, n) end
      while ended == nil do
        local e = event_end(pending)
        if e == nil then break end
        local event = sub(pending, 1, e)
        pending = sub(pending, e + 1)
        local data = event_data(event)
        local keep = true
        if data ~= nil and find(data, "^%s*%[DONE%]%s*$") then
          done = true
        elseif data ~= nil then
          local fields = object_fields(data)
          if fields == nil then
            ended = "malformed"
          elseif fields.error ~= nil then
            ended = "error"
          else
            local usage = fields.usage
            if usage ~= nil and byte(usage, 1) == 123 then
              metadata(h, K.usage_prompt, usage_number(usage, "prompt_tokens"))
              metadata(h, K.usage_completion, usage_number(usage, "completion_tokens"))
              metadata(h, K.usage_cached, usage_number(usage, "cached_tokens"))
              keep = not (withhold and (fields.choices == nil or find(fields.choices, "^%[%s*%]$")))
            end
            if fields.choices ~= nil and content_chunk(fields.choices) then chunks = chunks + 1 end
          end
        end
        if ended ~= nil then break end
        if keep then out[#out + 1] = event end
      end
      if ended == nil and #pending > MAX_EVENT then ended = "oversized" end
      if ended == nil and at_end and not done then ended = "unfinished" end
      if ended ~= nil then out[#out + 1] = EVENT[ended] end
    end
    chunk:setBytes(concat(out))
    if chunks ~= counted then
      counted = chunks
      metadata(h, K.stream_chunks, chunks)
    end
    if at_end then break end
  end
  -- Reached only when the stream ended (a cut one never resumes this): how it ended, for settlement.
  metadata(h, K.stream_end, ended or (done and "done") or "unfinished")
end
