-- The Anthropic door's answers, streams and errors (the renderer puts this into extproc/lua/doors.lua).

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

-- Anthropic's usage: `input_tokens` are those the cache neither read nor wrote; the writes, by TTL.
local function anthropic_usage(usage)
  local input, cached, output, _, writes, writes_1h = internal_usage(usage)
  if input == nil then return nil end
  return concat({'{"input_tokens":', format("%d", input - cached - writes - writes_1h),
                 ',"cache_creation_input_tokens":', format("%d", writes + writes_1h),
                 ',"cache_read_input_tokens":', format("%d", cached),
                 ',"cache_creation":{"ephemeral_5m_input_tokens":', format("%d", writes),
                 ',"ephemeral_1h_input_tokens":', format("%d", writes_1h), '}',
                 ',"output_tokens":', format("%d", output), "}"})
end

-- The stop reason and sequence of a choice's finish (vLLM names the stop string that ended the text).
-- A turn that ended on a tool call is `tool_use` whatever the finish says: vLLM finishes a forced
-- (named) tool call with "stop", and an agent loop runs the tool only on `tool_use`.
local function anthropic_stop(finish, stop_reason, called)
  if finish == "stop" and called then return "tool_use", nil end
  if finish == "stop" and type(stop_reason) == "string" then return "stop_sequence", stop_reason end
  return type(finish) == "string" and A.stop_reasons[finish] or "end_turn", nil
end

local function message_id(id)  -- an upstream's own `msg_` id is kept as it is
  local bare = without_prefix(id)
  return sub(bare, 1, 4) == "msg_" and bare or "msg_" .. bare
end

-- An internal chat completion as a Message (its first choice: the Messages API has no `n`).
local function anthropic_answer(doc)
  local id, model, choice, msg, text, calls = first_message(doc)
  if id == nil then return nil end
  local content, reasoning = {}, reasoning_of(msg)
  if reasoning then  -- first, as the model thought before it answered; signed when the provider signed it
    content[1] = concat({'{"type":"thinking","thinking":', str(reasoning), ',"signature":',
                         str(text_of(msg.reasoning_signature, "") or ""), "}"})
  end
  if text ~= "" then content[#content + 1] = '{"type":"text","text":' .. str(text) .. "}" end
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
  local reason, sequence = anthropic_stop(choice.finish_reason, choice.stop_reason, #calls > 0)
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

local THINKING_BLOCK = '{"type":"thinking","thinking":"","signature":""}'

-- A delta of the block `key` (opened first, closing the one open): text, thinking, or the provider's
-- signature that ends a thinking block.
local function anthropic_delta(st, out, key, block, kind, field, value)
  if st.open ~= key then anthropic_open(st, out, key, block) end
  out[#out + 1] = anthropic_event("content_block_delta", concat({format('"index":%d,', st.index), '"delta":{"type":"',
                                                                 kind, '","', field, '":', str(value), "}"}))
end

local function anthropic_text(st, text, out)
  anthropic_delta(st, out, "text", '{"type":"text","text":""}', "text_delta", "text", text)
end

local function anthropic_reasoning(st, text, out)
  anthropic_delta(st, out, "thinking", THINKING_BLOCK, "thinking_delta", "thinking", text)
end

local function anthropic_signature(st, signature, out)
  anthropic_delta(st, out, "thinking", THINKING_BLOCK, "signature_delta", "signature", signature)
end

local function anthropic_call(st, n, call, fn, out)
  local key = "tool" .. format("%d", n)
  st.called = true
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
  st.reason, st.sequence = anthropic_stop(finish, choice.stop_reason, st.called)
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
  return {started = false, index = -1, open = nil, reason = "end_turn", sequence = nil, usage = nil, called = false}
end

-- A token count (count_tokens) in Anthropic's shape.
local function anthropic_count(n)
  return '{"input_tokens":' .. n .. "}"
end

DOORS.anthropic = {answer = anthropic_answer, count = anthropic_count, error = anthropic_error, error_body = anthropic_error_body,
               stream = anthropic_stream, begin = anthropic_begin, usage = anthropic_usage, text = anthropic_text,
               reasoning = anthropic_reasoning, signature = anthropic_signature,
               call = anthropic_call, finish = anthropic_finish, done = anthropic_done,
               error_event = anthropic_error_event,
               request_id_header = "request-id"}  -- the anthropic SDK's `.request_id` / `_request_id`
