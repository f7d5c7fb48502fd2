-- The front doors' answers, in Envoy (LuaJIT): what a door's caller receives, in its own API's shape
-- (each shape's door.py in extproc/shapes/: Anthropic's Messages, Gemini's generateContent, OpenAI's
-- Responses). First in the chain after the
-- header mutation, so on the way out it runs last: json_to_metadata, the stream guards, the meter and
-- the attempt filter have read the internal shape, and settlement is untouched. The renderer
-- (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace and key names, each door's
-- status names and stop reasons from its Python module, the contract's codes) and extproc/lua/json.lua,
-- sse.lua and values.lua, and puts each registered door's translators (extproc/shapes/<shape>/door.lua)
-- where `@shapes` stands. Each translation is the Python door's (held to it by
-- tests/lua/test_lua_doors.py); the Python door still reads the caller's request at intake.
--
-- - A 2xx JSON answer (a chat completion) is read whole and written in the door's shape; one that
--   cannot be (not a chat completion, a count that is not one) is the door's 502 `upstream_error` -
--   the status too, since nothing has left yet.
-- - A 200 stream (internal SSE, already whole events from the stream guard) is translated event by
--   event; `[DONE]` ends it with the door's own end events, and the contract's interruption, a
--   malformed event, one over the size bound or an end before `[DONE]` with the door's error event;
--   nothing follows either.
-- - Any other status: its body in the door's error shape (one already in it is kept: ext_proc's
--   refusals, Envoy's own replies and custom_response's are written in it).

local concat, format = table.concat, string.format
local K, NS = CONFIG.keys, CONFIG.namespace
local UPSTREAM_ERROR, STREAM_INTERRUPTED = CONFIG.upstream_error, CONFIG.stream_interrupted

local function str(s) return '"' .. s .. '"' end  -- an escaped text as a JSON string

-- An error field as the Python door reads it (`str()`): a string as it is, a number, a boolean or null
-- as Python writes them; `default` when absent.
local function as_text(v, default)
  if v == nil then return default end
  if type(v) == "string" then return v end
  if v == NULL then return "None" end
  if type(v) == "boolean" then return v and "True" or "False" end
  if type(v) == "number" and v == math.floor(v) and v > -1e15 and v < 1e15 then return format("%d", v) end
  return default
end

-- The internal usage's counts (extproc/settlement/charge.py `token_classes` reads them the same way): input
-- (every prompt token), cache reads, output, of the output the reasoning's, and of the input the cache
-- writes at the 5-minute and the 1-hour rate (each part at most what is left of its whole); nil when a
-- count is not one (the door cannot carry it).
local function internal_usage(usage)
  if not is_object(usage) then usage = {} end  -- (no usage object: no counts)
  local details, out_details = object_of(usage.prompt_tokens_details), object_of(usage.completion_tokens_details)
  if details == nil or out_details == nil then return nil end
  local input, cached, output = count(usage.prompt_tokens), count(details.cached_tokens), count(usage.completion_tokens)
  local reasoning, writes, writes_1h = count(out_details.reasoning_tokens), count(details.cache_write_tokens),
    count(details.cache_write_1h_tokens)
  if input == nil or cached == nil or output == nil or reasoning == nil or writes == nil or writes_1h == nil then
    return nil
  end
  cached = math.min(cached, input)
  writes = math.min(writes, input - cached)
  return input, cached, output, math.min(reasoning, output), writes, math.min(writes_1h, input - cached - writes)
end

-- A message's (or a delta's) reasoning text, as vLLM names it (`reasoning`, or the older
-- `reasoning_content`); nil when there is none or it is not a string.
local function reasoning_of(msg)
  local r = msg.reasoning
  if absent(r) then r = msg.reasoning_content end
  return (type(r) == "string" and r ~= "") and r or nil
end

-- A tool call's arguments (a JSON string holding JSON text) as the JSON object they stand for; `{}`
-- when they are not one; nil when they are not a string.
local function arguments_object(arguments)
  if absent(arguments) then return "{}" end
  if type(arguments) ~= "string" then return nil end
  local text = unescape(arguments)
  local doc = decode_all(text ~= "" and text or "{}")
  if not is_object(doc) then return "{}" end
  local span = SPAN[doc]
  return sub(text ~= "" and text or "{}", span[1], span[2])
end

-- A message's text: "" when absent; nil when it is not a string.
local function message_text(msg)
  if absent(msg.content) then return "" end
  if type(msg.content) ~= "string" then return nil end
  return msg.content
end

local function without_prefix(id)  -- an internal id without its `chatcmpl-`
  return (sub(id, 1, 9) == "chatcmpl-") and sub(id, 10) or id
end

-- An internal chat completion's id, model, first choice, its message, the message's text and tool
-- calls (the doors have no `n`: they answer the first choice); nil when the answer is not one.
local function first_message(doc)
  local choices = list_of(doc.choices)
  local id, model = text_of(doc.id, ""), text_of(doc.model, "")
  if choices == nil or id == nil or model == nil then return nil end
  local choice = choices[1] or {}
  if choices[1] ~= nil and not is_object(choice) then return nil end
  local msg = object_of(choice.message)
  if msg == nil then return nil end
  local text, calls = message_text(msg), list_of(msg.tool_calls)
  if text == nil or calls == nil then return nil end
  return id, model, choice, msg, text, calls
end

local DONE = "^%s*%[DONE%]%s*$"

-- Each door's translators, by door name.
local DOORS = {}

-- @shapes

-- ---- the filter ----------------------------------------------------------------------------------

-- Every door the registry names has its translators (a door registered without them stops the filter
-- from loading).
for _, name in ipairs(CONFIG.doors) do
  if DOORS[name] == nil then error("the door filter has no translators for the door " .. name) end
end

-- An internal chunk walked for a door (the Python doors' `_chunk`): the door begins (its stream's
-- start), keeps the usage in its own shape, and gets the first choice's reasoning (and the provider's
-- signature over it), text, each tool call delta and the finish. True; false when the chunk is not
-- one; a message when its usage holds a count that is not one.
local function walk_chunk(door, st, obj, out)
  if not door.begin(st, obj, out) then return false end
  if is_object(obj.usage) then
    st.usage = door.usage(obj.usage)
    if st.usage == nil then return "a token count no upstream gives" end
  end
  local choices = list_of(obj.choices)
  if choices == nil then return false end
  for _, choice in ipairs(choices) do
    if is_object(choice) and (absent(choice.index) or choice.index == 0) then
      local delta = object_of(choice.delta)
      local calls = delta and list_of(delta.tool_calls)
      if not calls then return false end
      local reasoning, signature = reasoning_of(delta), delta.reasoning_signature
      if reasoning then door.reasoning(st, reasoning, out) end
      if type(signature) == "string" and signature ~= "" then door.signature(st, signature, out) end
      local text = delta.content
      if type(text) == "string" and text ~= "" then door.text(st, text, out) end
      for _, call in ipairs(calls) do
        local fn = is_object(call) and object_of(call["function"])
        local n = fn and (absent(call.index) and 0 or call.index)
        if type(n) ~= "number" or not door.call(st, n, call, fn, out) then return false end
      end
      local finish = choice.finish_reason
      if type(finish) == "string" and finish ~= "" then door.finish(st, finish, choice, out) end
    end
  end
  return true
end

-- The Responses door's tool namespaces (K.namespaces, comma-separated): a set, or nil.
local function namespaces_of(md)
  local list = md[K.namespaces]
  if type(list) ~= "string" or list == "" then return nil end
  local set = {}
  for ns in string.gmatch(list, "[^,]+") do set[ns] = true end
  return set
end

-- One internal event's data: its events added to `out`; true once the stream has ended.
local function door_event(door, st, data, out)
  if find(data, DONE) then
    door.done(st, out)
    return true
  end
  local doc = decode_all(data)
  if not is_object(doc) then
    out[#out + 1] = door.error_event("the stream is malformed", st)
    return true
  end
  if doc.error ~= nil then  -- the contract's stream_interrupted (or an upstream's error event)
    local message = is_object(doc.error) and text_of(doc.error.message, nil)
    out[#out + 1] = door.error_event(message or "the stream was interrupted", st)
    return true
  end
  local ok = walk_chunk(door, st, doc, out)
  if ok ~= true then
    out[#out + 1] = door.error_event(ok or "the stream is malformed", st)
    return true
  end
  return false
end

local function translate_stream(h, door, namespaces)
  local st, split = door.stream(), event_splitter()
  st.namespaces = namespaces
  rewrite_chunks(h, function(bytes, at_end)
    local out, ended, events = {}, false, {}
    local held = split(bytes, events)
    for _, event in ipairs(events) do
      local data = event_data(event)
      if data ~= nil then ended = door_event(door, st, data, out) end  -- (no data: a comment)
      if ended then break end
    end
    if not ended and held > CONFIG.max_event_bytes then
      ended = true
      out[#out + 1] = door.error_event("an event of the stream exceeds 1 MiB", st)
    end
    if not ended and at_end then
      ended = true
      out[#out + 1] = door.error_event("the stream ended before its end", st)
    end
    return concat(out), ended
  end)
end

-- A token count's answer (extproc/direct.py count_request): the count from the field of the shape that
-- counted (CONFIG.count_fields), in the door's shape; kept in the metadata (usage_prompt) for the
-- ledger's `counted_tokens` (settlement charges a count nothing and records no usage). An answer
-- without a count is the door's 502.
local function door_count(h, door, md, text)
  local doc = decode_all(text)
  local field = CONFIG.count_fields[md[K.count]]
  local given = is_object(doc) and field and doc[field]
  local n = given ~= nil and given ~= false and not absent(given) and count(given)
  if not n then
    h:streamInfo():dynamicMetadata():set(NS, K.answer_broken, "1")
    return door.error_body(502, "the upstream's count could not be read", UPSTREAM_ERROR), true
  end
  h:streamInfo():dynamicMetadata():set(NS, K.usage_prompt, n)  -- a number, as the stream guard records one
  return door.count(format("%d", n)), false
end

function envoy_on_response(h)
  local md = h:streamInfo():dynamicMetadata():get(NS)
  local door = md and DOORS[md[K.door] or ""]
  if door == nil then return end
  local headers = h:headers()
  local status = tonumber(headers:get(":status")) or 0
  headers:remove("content-length")  -- the caller's body has another length: Envoy frames it
  -- The request's id (the ledger's, x-request-id's) where the door's SDK reads it; Envoy adds
  -- x-request-id to the answer only after the filters.
  local rid = door.request_id_header and md[K.request_id]
  if type(rid) == "string" then headers:replace(door.request_id_header, rid) end
  if status == 200 and find(headers:get("content-type") or "", "^%s*text/event%-stream") then
    translate_stream(h, door, namespaces_of(md))
    return
  end
  local body = h:body()
  if body == nil then return end
  local text, out, broken = body:getBytes(0, body:length()), nil, false
  if status >= 200 and status < 300 and md[K.count] ~= nil then
    out, broken = door_count(h, door, md, text)
  elseif status >= 200 and status < 300 then
    local doc = decode_all(text)
    out = is_object(doc) and door.answer(doc, namespaces_of(md))
    if not out then
      out, broken = door.error_body(502, "the upstream's answer could not be read", UPSTREAM_ERROR), true
    end
  else
    out = door.error(status, text)
  end
  if broken then
    h:headers():replace(":status", "502")  -- (the handle taken before the body was read is out of scope)
    h:headers():replace("content-type", "application/json")
    h:headers():replace(CONFIG.should_retry_header, "false")  -- the upstream did the work: a retry pays again
    h:streamInfo():dynamicMetadata():set(NS, K.answer_broken, "1")  -- settlement: charged, never released
  end
  body:setBytes(out)
end
