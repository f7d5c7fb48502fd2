-- The front doors' answers, in Envoy (LuaJIT): what a door's caller receives, in its own API's shape
-- (each shape's door.py in extproc/shapes/: Anthropic's Messages, Gemini's generateContent). First in the chain after the
-- header mutation, so on the way out it runs last: json_to_metadata, the stream guards, the meter and
-- the attempt filter have read the internal shape, and settlement is untouched. The renderer
-- (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace and key names, each door's
-- status names and stop reasons from its Python module, the contract's codes) and extproc/lua/json.lua,
-- sse.lua and values.lua. Each translation is the Python door's (held to it by
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

-- The internal usage's counts (extproc/shapes/openai/adapter.py `usage`): input, cached input, output; nil
-- when a count is not one (the door cannot carry it).
local function internal_usage(usage)
  if not is_object(usage) then usage = {} end  -- (no usage object: no counts)
  local details, out_details = object_of(usage.prompt_tokens_details), object_of(usage.completion_tokens_details)
  if details == nil or out_details == nil then return nil end
  local input, cached, output = count(usage.prompt_tokens), count(details.cached_tokens), count(usage.completion_tokens)
  if input == nil or cached == nil or output == nil or count(out_details.reasoning_tokens) == nil then return nil end
  return input, cached, output
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

local DONE = "^%s*%[DONE%]%s*$"

-- ---- Anthropic's Messages API (extproc/shapes/anthropic/door.py) ---------------------------------------

local A = CONFIG.anthropic

local function anthropic_error_body(status, message, code, param)
  return concat({'{"type":"error","error":{"type":', str(A.error_types[status] or "api_error"), ',"message":',
                 str(message), ',"code":', str(code), param and (',"param":' .. str(param)) or "", "}}"})
end

-- A contract error (or any non-2xx body) in Anthropic's shape; one already in it is kept.
local function anthropic_error(status, body)
  local doc = decode_all(body)
  if is_object(doc) and doc.type == "error" then return body end
  local err = is_object(doc) and doc.error
  if not is_object(err) then
    return anthropic_error_body(status, format("the gateway answered %d", status), UPSTREAM_ERROR)
  end
  local param = text_of(err.param, nil)
  return anthropic_error_body(status, as_text(err.message, ""), as_text(err.code, ""), param ~= "" and param or nil)
end

local function anthropic_usage(usage)
  local input, cached, output = internal_usage(usage)
  if input == nil then return nil end
  return concat({'{"input_tokens":', format("%d", input > cached and input - cached or 0),
                 ',"cache_creation_input_tokens":0,"cache_read_input_tokens":', format("%d", cached),
                 ',"output_tokens":', format("%d", output), "}"})
end

-- The stop reason and sequence of a choice's finish (vLLM names the stop string that ended the text).
local function anthropic_stop(finish, stop_reason)
  if finish == "stop" and type(stop_reason) == "string" then return "stop_sequence", stop_reason end
  return type(finish) == "string" and A.stop_reasons[finish] or "end_turn", nil
end

local function message_id(id)
  return "msg_" .. without_prefix(id)
end

-- An internal chat completion as a Message (its first choice: the Messages API has no `n`).
local function anthropic_answer(doc)
  local choices = list_of(doc.choices)
  local id, model = text_of(doc.id, ""), text_of(doc.model, "")
  if choices == nil or id == nil or model == nil then return nil end
  local choice = choices[1] or {}
  if choices[1] ~= nil and not is_object(choice) then return nil end
  local msg = object_of(choice.message)
  if msg == nil then return nil end
  local text, calls = message_text(msg), list_of(msg.tool_calls)
  if text == nil or calls == nil then return nil end
  local content = {}
  if text ~= "" then content[1] = '{"type":"text","text":' .. str(text) .. "}" end
  for _, call in ipairs(calls) do
    local fn = is_object(call) and object_of(call["function"])
    local call_id, name = fn and text_of(call.id, ""), fn and text_of(fn.name, "")
    local input = fn and arguments_object(fn.arguments)
    if not (call_id and name and input) then return nil end
    content[#content + 1] = concat({'{"type":"tool_use","id":', str(call_id), ',"name":', str(name),
                                    ',"input":', input, "}"})
  end
  local usage = anthropic_usage(doc.usage)
  if usage == nil then return nil end
  local reason, sequence = anthropic_stop(choice.finish_reason, choice.stop_reason)
  return concat({'{"id":', str(message_id(id)), ',"type":"message","role":"assistant","model":', str(model),
                 ',"content":[', concat(content, ","), '],"stop_reason":', str(reason), ',"stop_sequence":',
                 sequence and str(sequence) or "null", ',"usage":', usage, "}"})
end

local function anthropic_event(kind, fields)
  return concat({"event: ", kind, '\ndata: {"type":"', kind, '"', fields ~= "" and "," or "", fields, "}\n\n"})
end

local function anthropic_error_event(message)
  return anthropic_event("error", concat({'"error":{"type":"api_error","message":', str(message), ',"code":',
                                          str(STREAM_INTERRUPTED), "}"}))
end

local function anthropic_start(st, id, model)
  st.started = true
  return anthropic_event("message_start", concat({
    '"message":{"id":', str(message_id(id)), ',"type":"message","role":"assistant","model":', str(model),
    ',"content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":0,',
    '"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}}'}))
end

local function anthropic_close(st, out)
  if st.open == nil then return end
  st.open = nil
  out[#out + 1] = anthropic_event("content_block_stop", format('"index":%d', st.index))
end

local function anthropic_open(st, out, key, block)
  anthropic_close(st, out)
  st.index, st.open = st.index + 1, key
  out[#out + 1] = anthropic_event("content_block_start", format('"index":%d,"content_block":', st.index) .. block)
end

-- An internal chunk as Anthropic's events (MessagesStream._chunk), walked by walk_chunk below.
local function anthropic_begin(st, obj, out)
  if st.started then return true end
  local id, model = text_of(obj.id, ""), text_of(obj.model, "")
  if id == nil or model == nil then return false end
  out[#out + 1] = anthropic_start(st, id, model)
  return true
end

local function anthropic_text(st, text, out)
  if st.open ~= "text" then anthropic_open(st, out, "text", '{"type":"text","text":""}') end
  out[#out + 1] = anthropic_event("content_block_delta", format('"index":%d,', st.index)
                                  .. '"delta":{"type":"text_delta","text":' .. str(text) .. "}")
end

local function anthropic_call(st, n, call, fn, out)
  local key = "tool" .. format("%d", n)
  if st.open ~= key then
    local call_id, name = text_of(call.id, ""), text_of(fn.name, "")
    if call_id == nil or name == nil then return false end
    anthropic_open(st, out, key, concat({'{"type":"tool_use","id":', str(call_id), ',"name":', str(name),
                                         ',"input":{}}'}))
  end
  local arguments = fn.arguments
  if type(arguments) == "string" and arguments ~= "" then
    out[#out + 1] = anthropic_event("content_block_delta", format('"index":%d,', st.index)
                                    .. '"delta":{"type":"input_json_delta","partial_json":' .. str(arguments) .. "}")
  end
  return true
end

local function anthropic_finish(st, finish, choice, out)
  anthropic_close(st, out)
  st.reason, st.sequence = anthropic_stop(finish, choice.stop_reason)
end

local function anthropic_done(st, out)
  if not st.started then out[#out + 1] = anthropic_start(st, "", "") end
  anthropic_close(st, out)
  out[#out + 1] = anthropic_event("message_delta", concat({
    '"delta":{"stop_reason":', str(st.reason), ',"stop_sequence":', st.sequence and str(st.sequence) or "null",
    '},"usage":', st.usage or '{"output_tokens":0}'}))
  out[#out + 1] = anthropic_event("message_stop", "")
end

local function anthropic_stream()
  return {started = false, index = -1, open = nil, reason = "end_turn", sequence = nil, usage = nil}
end

-- ---- Gemini's generateContent (extproc/shapes/gemini/door.py) ------------------------------------------

local G = CONFIG.gemini

local function gemini_error_body(status, message, code)
  return concat({'{"error":{"code":', format("%d", status), ',"message":', str(message), ',"status":',
                 str(G.statuses[status] or "UNKNOWN"),
                 ',"details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":', str(code),
                 ',"domain":"llmgw"}]}}'})
end

-- A contract error (or any non-2xx body) in Google's shape; one already in it is kept.
local function gemini_error(status, body)
  local doc = decode_all(body)
  local err = is_object(doc) and doc.error
  if is_object(err) and err.status ~= nil then return body end
  if not is_object(err) then
    return gemini_error_body(status, format("the gateway answered %d", status), UPSTREAM_ERROR)
  end
  return gemini_error_body(status, as_text(err.message, ""), as_text(err.code, ""))
end

local function gemini_usage(usage)
  local input, cached, output = internal_usage(usage)
  if input == nil then return nil end
  return concat({'{"promptTokenCount":', format("%d", input), ',"candidatesTokenCount":', format("%d", output),
                 ',"totalTokenCount":', format("%d", input + output),
                 cached > 0 and (',"cachedContentTokenCount":' .. format("%d", cached)) or "", "}"})
end

local function gemini_finish(finish)
  return type(finish) == "string" and G.finish[finish] or "OTHER"
end

local function function_call(name, arguments)
  local args = arguments_object(arguments)
  if args == nil then return nil end
  return concat({'{"functionCall":{"name":', str(name), ',"args":', args, "}}"})
end

-- An internal chat completion as a GenerateContentResponse: a candidate per choice.
local function gemini_answer(doc)
  local choices = list_of(doc.choices)
  local id, model = text_of(doc.id, ""), text_of(doc.model, "")
  if choices == nil or id == nil or model == nil then return nil end
  local candidates = {}
  for _, choice in ipairs(choices) do
    local msg = is_object(choice) and object_of(choice.message)
    local text, calls = msg and message_text(msg), msg and list_of(msg.tool_calls)
    if not (text and calls) then return nil end
    local parts = {}
    if text ~= "" then parts[1] = '{"text":' .. str(text) .. "}" end
    for _, call in ipairs(calls) do
      local fn = is_object(call) and object_of(call["function"])
      local name = fn and text_of(fn.name, "")
      local part = name and function_call(name, fn.arguments)
      if not part then return nil end
      parts[#parts + 1] = part
    end
    local index = absent(choice.index) and 0 or choice.index
    if type(index) ~= "number" or index ~= math.floor(index) then return nil end
    candidates[#candidates + 1] = concat({'{"content":{"role":"model","parts":[',
                                          #parts > 0 and concat(parts, ",") or '{"text":""}', ']},"finishReason":',
                                          str(gemini_finish(choice.finish_reason)), ',"index":', format("%d", index),
                                          "}"})
  end
  local usage = gemini_usage(doc.usage)
  if usage == nil then return nil end
  return concat({'{"candidates":[', concat(candidates, ","), '],"usageMetadata":', usage, ',"modelVersion":',
                 str(model), ',"responseId":', str(without_prefix(id)), "}"})
end

local function gemini_frame(doc)
  return "data: " .. doc .. "\r\n\r\n"
end

local function gemini_response(st, parts, finish)
  return gemini_frame(concat({'{"candidates":[{"content":{"role":"model","parts":[', parts, ']},"index":0',
                              finish and (',"finishReason":' .. str(finish)) or "", '}],"modelVersion":',
                              str(st.model), ',"responseId":', str(st.id), st.usage_tail or "", "}"}))
end

local function gemini_error_event(message)
  return gemini_frame(gemini_error_body(500, message, STREAM_INTERRUPTED))
end

-- An internal chunk as Gemini's stream (GenerateContentStream._chunk), walked by walk_chunk below: text
-- leaves at once, tool calls whole with the last response.
local function gemini_begin(st, obj, out)
  local id, model = text_of(obj.id, ""), text_of(obj.model, "")
  if id == nil or model == nil then return false end
  if st.id == "" then st.id = without_prefix(id) end
  if st.model == "" then st.model = model end
  return true
end

local function gemini_text(st, text, out)
  out[#out + 1] = gemini_response(st, '{"text":' .. str(text) .. "}")
end

local function gemini_call_delta(st, n, call, fn, out)
  local name, arguments = text_of(fn.name, ""), text_of(fn.arguments, "")
  if name == nil or arguments == nil then return false end
  local c = st.calls[n]
  if c == nil then
    c = {name = {}, arguments = {}}
    st.calls[n] = c
    st.order[#st.order + 1] = n
  end
  c.name[#c.name + 1], c.arguments[#c.arguments + 1] = name, arguments
  return true
end

local function gemini_finish_choice(st, finish, choice, out)
  st.finish = gemini_finish(finish)
end

local function gemini_done(st, out)
  table.sort(st.order)
  local parts = {}
  for _, n in ipairs(st.order) do
    local c = st.calls[n]
    parts[#parts + 1] = function_call(concat(c.name), concat(c.arguments))  -- (arguments are a string)
  end
  st.usage_tail = st.usage and (',"usageMetadata":' .. st.usage) or nil
  out[#out + 1] = gemini_response(st, #parts > 0 and concat(parts, ",") or '{"text":""}', st.finish or "STOP")
end

local function gemini_stream()
  return {id = "", model = "", calls = {}, order = {}, finish = nil, usage = nil}
end

-- ---- the filter ----------------------------------------------------------------------------------

local DOORS = {
  anthropic = {answer = anthropic_answer, error = anthropic_error, error_body = anthropic_error_body,
               stream = anthropic_stream, begin = anthropic_begin, usage = anthropic_usage, text = anthropic_text,
               call = anthropic_call, finish = anthropic_finish, done = anthropic_done,
               error_event = anthropic_error_event},
  gemini = {answer = gemini_answer, error = gemini_error, error_body = gemini_error_body,
            stream = gemini_stream, begin = gemini_begin, usage = gemini_usage, text = gemini_text,
            call = gemini_call_delta, finish = gemini_finish_choice, done = gemini_done,
            error_event = gemini_error_event},
}

-- An internal chunk walked for a door (the Python doors' `_chunk`): the door begins (its stream's
-- start), keeps the usage in its own shape, and gets the first choice's text, each tool call delta
-- and the finish. True; false when the chunk is not one; a message when its usage holds a count that
-- is not one.
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

-- One internal event's data: its events added to `out`; true once the stream has ended.
local function door_event(door, st, data, out)
  if find(data, DONE) then
    door.done(st, out)
    return true
  end
  local doc = decode_all(data)
  if not is_object(doc) then
    out[#out + 1] = door.error_event("the stream is malformed")
    return true
  end
  if doc.error ~= nil then  -- the contract's stream_interrupted (or an upstream's error event)
    local message = is_object(doc.error) and text_of(doc.error.message, nil)
    out[#out + 1] = door.error_event(message or "the stream was interrupted")
    return true
  end
  local ok = walk_chunk(door, st, doc, out)
  if ok ~= true then
    out[#out + 1] = door.error_event(ok or "the stream is malformed")
    return true
  end
  return false
end

local function translate_stream(h, door)
  local st, split = door.stream(), event_splitter()
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
      out[#out + 1] = door.error_event("an event of the stream exceeds 1 MiB")
    end
    if not ended and at_end then
      ended = true
      out[#out + 1] = door.error_event("the stream ended before its end")
    end
    return concat(out), ended
  end)
end

function envoy_on_response(h)
  local md = h:streamInfo():dynamicMetadata():get(NS)
  local door = md and DOORS[md[K.door] or ""]
  if door == nil then return end
  local headers = h:headers()
  local status = tonumber(headers:get(":status")) or 0
  headers:remove("content-length")  -- the caller's body has another length: Envoy frames it
  if status == 200 and find(headers:get("content-type") or "", "^%s*text/event%-stream") then
    translate_stream(h, door)
    return
  end
  local body = h:body()
  if body == nil then return end
  local text, out, broken = body:getBytes(0, body:length()), nil, false
  if status >= 200 and status < 300 then
    local doc = decode_all(text)
    out = is_object(doc) and door.answer(doc)
    if not out then
      out, broken = door.error_body(502, "the upstream's answer could not be read", UPSTREAM_ERROR), true
    end
  else
    out = door.error(status, text)
  end
  if broken then
    h:headers():replace(":status", "502")  -- (the handle taken before the body was read is out of scope)
    h:headers():replace("content-type", "application/json")
    h:streamInfo():dynamicMetadata():set(NS, K.answer_broken, "1")  -- settlement: charged, never released
  end
  body:setBytes(out)
end
