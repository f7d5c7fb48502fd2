-- The stream guard, in Envoy (LuaJIT): every chunk of an admitted stream passes here, with no round
-- trip to ext_proc. The renderer (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace,
-- the io.llmgw key names from extproc/names.py, the contract's `stream_interrupted` events) and
-- extproc/lua/json.lua and extproc/lua/sse.lua (its JSON checker, its SSE framing).
--
-- - Whole events only: the start of an event still arriving is held back until the rest comes.
-- - Each event's data is checked to be a chunk (a JSON object with a list of choices, or usage) or
--   [DONE]: a malformed event (an object that is no chunk among them), an upstream error event,
--   an event over the size bound, or an end without [DONE] ends the client's stream with the contract's
--   `stream_interrupted` event; nothing after it reaches the client.
-- - The usage chunk the gateway asked for on the client's behalf is withheld from that client; its
--   numbers go into the request's metadata, where the access log carries them to settlement.
-- - The count of chunks that carried generated content is kept in the metadata as it grows, so a
--   stream Envoy cuts (client gone, reset, idle) settles from the access log with what was generated;
--   the time the first of them came is kept too: the stream's time to first token.
-- - Past the stream's end time (max_stream_ms, from its admission) the next chunk is replaced by the
--   `stream_interrupted` event; Envoy's own timer, set by ext_proc a little later, then resets the
--   exchange so the engine stops generating.
-- - Each chunk names the route the caller asked for as its `model`, and so does a JSON answer (on the
--   admitted JSON routes the guard's script runs for that alone): a client that replays an earlier
--   answer (Claude Code's signed thinking) compares that name with the one it asked for. The served
--   model was recorded first (upstream_model); it stays in x-llmgw-deployment and the ledger.

local find, sub, byte, concat = string.find, string.sub, string.byte, table.concat
local K, EVENT, MAX_EVENT, NS = CONFIG.keys, CONFIG.events, CONFIG.max_event_bytes, CONFIG.namespace

-- The index after the JSON value at (or after whitespace from) i, or nil when the text there is not
-- JSON. For the top-level object, `fields` gets the text of the values of `error`, `usage`,
-- `choices`, `model` and `id` (the only fields the guard reads), and `model_at` where the model's is.
local value
value = function(s, i, depth, fields)
  if depth > MAX_DEPTH then return nil end
  local c
  i, c = skip(s, i)
  if c == 123 then  -- {
    i, c = skip(s, i + 1)
    if c == 125 then return i + 1 end
    while true do
      if c ~= 34 then return nil end
      local after = json_string(s, i)
      if after == nil then return nil end
      local name = nil
      if fields ~= nil and (after - i == 7 or after - i == 9 or after - i == 4) then name = sub(s, i + 1, after - 2) end
      i, c = skip(s, after)
      if c ~= 58 then return nil end  -- :
      local from = skip(s, i + 1)
      i = value(s, from, depth + 1, nil)
      if i == nil then return nil end
      if name ~= nil then
        fields[name] = sub(s, from, i - 1)
        if name == "model" then fields.model_at = from end
      end
      i, c = skip(s, i)
      if c == 125 then return i + 1 end
      if c ~= 44 then return nil end  -- ,
      i, c = skip(s, i + 1)
    end
  elseif c == 91 then  -- [
    i, c = skip(s, i + 1)
    if c == 93 then return i + 1 end
    while true do
      i = value(s, i, depth + 1, nil)
      if i == nil then return nil end
      i, c = skip(s, i)
      if c == 93 then return i + 1 end
      if c ~= 44 then return nil end
      i = i + 1
    end
  elseif c == 34 then
    return json_string(s, i)
  elseif c == 116 then
    return literal(s, i, "true")
  elseif c == 102 then
    return literal(s, i, "false")
  elseif c == 110 then
    return literal(s, i, "null")
  end
  return number(s, i)
end

-- The fields the guard reads from an event's JSON object, or nil when its data is not a JSON object.
local function object_fields(data)
  local i, c = skip(data, 1)
  if c ~= 123 then return nil end
  local fields = {}
  local e = value(data, i, 0, fields)
  if e == nil or skip(data, e) <= #data then return nil end
  return fields
end

-- Whether a chunk's choices carry a field `name` whose value is a non-empty string (`kind` 34) or a
-- non-empty array (`kind` 91): generated text, a tool call or reasoning.
local function has_value(choices, name, kind)
  local at = 1
  while true do
    local _, e = find(choices, name, at, true)
    if e == nil then return false end
    local i, c = skip(choices, e + 1)
    if c == 58 then
      i, c = skip(choices, i + 1)
      if c == 34 and kind == 34 and byte(choices, i + 1) ~= 34 then return true end  -- not ""
      if c == 91 and kind == 91 and select(2, skip(choices, i + 1)) ~= 93 then return true end  -- not []
    end
    at = e + 1
  end
end

local function content_chunk(choices)
  return has_value(choices, '"content"', 34) or has_value(choices, '"tool_calls"', 91)
    or has_value(choices, '"reasoning"', 34) or has_value(choices, '"reasoning_content"', 34)
end

-- A usage count as the upstream wrote it, for settlement to judge (it believes only a whole number
-- from 0 to 2^53): any JSON number as a number, an absent or null one as 0, anything else (a string,
-- a boolean) as its text. (Reading digits alone took `-7` for 7 and `2.5` for 2.)
local function usage_number(usage, name)
  local _, _, v = find(usage, '"' .. name .. '"%s*:%s*([^,}%]%s]*)')
  if v == nil or v == "null" then return 0 end
  local n = find(v, "^%-?%d") and tonumber(v)  -- (the event is checked JSON: this is a JSON number)
  if n then return n end
  return sub(v, 1, 24)
end

-- A plain string value (no escapes, at most 128 bytes) as the event's JSON text has it, or nil: the
-- upstream's id for its answer and a choice's finish reason, which the ledger keeps.
local function plain_string(text)
  if text == nil then return nil end
  local _, _, v = find(text, '^"([^"\\]*)"$')
  if v == nil or #v > 128 then return nil end
  return v
end

local function finish_reason(choices)
  local _, _, v = find(choices, '"finish_reason"%s*:%s*"([^"\\]*)"')
  return v
end

-- The route the caller asked for as JSON text, or nil (route names are JSON-safe: [a-z0-9._-]).
local function route_model(md)
  local route = md[K.route]
  if type(route) ~= "string" or route == "" or find(route, '["\\]') then return nil end
  return '"' .. route .. '"'
end

-- `data`, a JSON object whose top-level fields are `fields`, naming `model` (JSON text) as its model;
-- nil when it names no model or already that one.
local function as_model(data, fields, model)
  local named = fields.model
  if model == nil or named == nil or named == model or byte(named, 1) ~= 34 then return nil end
  local at = fields.model_at
  return sub(data, 1, at - 1) .. model .. sub(data, at + #named)
end

-- A 2xx JSON answer naming the route as its model (its body read whole; one that is no JSON object
-- passes as it came, for the filters after this to judge).
local function json_answer(h, md)
  local model = route_model(md)
  if model == nil then return end
  local headers = h:headers()
  local status = tonumber(headers:get(":status")) or 0
  if status < 200 or status >= 300 or not find(headers:get("content-type") or "", "json", 1, true) then return end
  local body = h:body()
  if body == nil then return end
  local text = body:getBytes(0, body:length())
  local fields = object_fields(text)
  local renamed = fields and as_model(text, fields, model)
  if renamed then body:setBytes(renamed) end
end

-- The usage's token classes priced apart, by metadata key (absent from most usage: set only when there;
-- extproc/names.py USAGE_COUNTS).
local PRICED_APART = CONFIG.priced_apart

local function metadata(h, key, v)
  h:streamInfo():dynamicMetadata():set(NS, key, v)
end

function envoy_on_response(h)
  local md = h:streamInfo():dynamicMetadata():get(NS)
  if md == nil then return end
  if md[K.settle] ~= CONFIG.settle_stream then return json_answer(h, md) end
  local headers = h:headers()
  local status = tonumber(headers:get(":status")) or 0
  if status < 200 or status >= 300 then return end  -- an error status: already in the contract's shape
  -- Envoy's own degraded answer (every upstream was down): the gateway wrote it, whole; nothing to guard.
  if headers:get(CONFIG.degraded_header) == "response" then return end
  -- The body may change length (an event withheld or added): Envoy frames it itself.
  headers:remove("content-length")
  -- An upstream that answered a stream request with something else is broken: the client, which
  -- asked for a stream, gets one that ends with the contract's event.
  local sse = find(headers:get("content-type") or "", "^%s*text/event%-stream") ~= nil
  if not sse then headers:replace("content-type", "text/event-stream") end
  local withhold = md[K.withhold_usage] == "1"
  local asked = route_model(md)  -- the model each chunk names: the route's
  local ends_at = tonumber(md[K.stream_ends_at_ms] or "")
  local split, held, chunks, counted, ended, done, done_marked = event_splitter(), 0, 0, 0, nil, false, false
  local named = false  -- the upstream's id for its answer is recorded
  local last, last_text  -- the latest chunk and what it became: the end may come with it (no empty chunk)

  for chunk in h:bodyChunks() do
    local n = chunk:length()
    local at_end = n == 0  -- an HTTP/1 upstream's end of stream arrives as an empty last chunk
    local out, came = {}, nil  -- came: the chunk's bytes, once read
    if ended == nil and not sse then
      ended = "malformed"
      out[1] = EVENT.malformed
    elseif ended == nil and ends_at ~= nil and h:timestamp() >= ends_at then
      ended = "over"
      out[1] = EVENT.over
    elseif ended == nil then
      came = n > 0 and chunk:getBytes(0, n) or ""
      local events = {}
      held = split(came, events)
      for _, event in ipairs(events) do
        local data = event_data(event)
        local keep, fields = true, nil
        if data == "[DONE]" or (data ~= nil and byte(data, skip(data, 1)) == 91 and find(data, "^%s*%[DONE%]%s*$")) then
          done = true
        elseif data ~= nil then
          fields = object_fields(data)
          if fields == nil then
            ended = "malformed"
          elseif fields.error ~= nil then
            ended = "error"
          elseif (fields.choices == nil or byte(fields.choices, 1) ~= 91) and fields.usage == nil then
            ended = "malformed"  -- JSON, but no chunk: neither a list of choices nor a usage chunk
          else
            local usage = fields.usage
            if usage ~= nil and byte(usage, 1) == 123 then
              metadata(h, K.usage_prompt, usage_number(usage, "prompt_tokens"))
              metadata(h, K.usage_completion, usage_number(usage, "completion_tokens"))
              metadata(h, K.usage_cached, usage_number(usage, "cached_tokens"))
              for key, name in pairs(PRICED_APART) do
                if find(usage, name, 1, true) then metadata(h, key, usage_number(usage, name)) end
              end
              keep = not (withhold and (fields.choices == nil or find(fields.choices, "^%[%s*%]$")))
            end
            if fields.choices ~= nil and content_chunk(fields.choices) then
              chunks = chunks + 1
              -- The first token's time (not the headers', which an engine sends before it prefills).
              if chunks == 1 then
                metadata(h, K.first_token_at_us, h:timestampString(EnvoyTimestampResolution.MICROSECOND))
              end
            end
            if not named then  -- the upstream's own id for the answer and its model, from its first chunk
              named = true
              local id = plain_string(fields.id)
              if id ~= nil then metadata(h, K.upstream_id, id) end
              local model = plain_string(fields.model)
              if model ~= nil then metadata(h, K.upstream_model, model) end
            end
            local finish = fields.choices ~= nil and find(fields.choices, "finish_reason", 1, true)
              and finish_reason(fields.choices)
            if finish then metadata(h, K.finish_reason, finish) end
          end
        end
        if ended ~= nil then break end
        local renamed = keep and fields ~= nil and as_model(data, fields, asked)
        if renamed then
          out[#out + 1] = "data: " .. renamed .. "\n\n"
        elseif keep then
          out[#out + 1] = event
        end
      end
      if ended == nil and held > MAX_EVENT then ended = "oversized" end
      if ended == nil and at_end and not done then ended = "unfinished" end
      if ended ~= nil then out[#out + 1] = EVENT[ended] end
    end
    -- Most chunks are one whole event, passed as they came; after the end, nothing reaches the client.
    -- One that completes no event (half of one, a withheld usage chunk) passes as an SSE comment: an
    -- empty chunk would read as the stream's end to a front door's Lua filter after this.
    local text = #out == 1 and out[1] or concat(out)
    if text == "" and not at_end and ended == nil and not done then text = CONFIG.keepalive end
    if text ~= came then chunk:setBytes(text) end
    last, last_text = chunk, text
    if chunks ~= counted then
      counted = chunks
      metadata(h, K.stream_chunks, chunks)
    end
    if done and ended == nil and not done_marked then
      -- The client has the whole stream once this chunk goes on: one that hangs up now, before the
      -- upstream's own end arrives, did not cancel (settlement reads this).
      done_marked = true
      metadata(h, K.stream_end, "done")
    end
    if at_end then break end
  end
  if ended == nil and not done and last ~= nil then
    -- The stream ended with its last bytes (no empty chunk after them) and without [DONE]: the
    -- contract's event joins that chunk, which Envoy passes on only now (rewrite_chunks in sse.lua).
    ended = "unfinished"
    pcall(last.setBytes, last, last_text .. EVENT.unfinished)
  end
  -- Reached only when the stream ended (a cut one never resumes this): how it ended, for settlement.
  metadata(h, K.stream_end, ended or (done and "done") or "unfinished")
end
