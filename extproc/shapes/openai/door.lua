-- The Responses door's answers, streams and errors (the renderer puts this into extproc/lua/doors.lua).

-- ---- OpenAI's Responses API (extproc/shapes/openai/door.py) -------------------------------------------

local R = CONFIG.responses

local function responses_error_body(status, message, code, param)
  return concat({'{"error":{"message":', str(message), ',"type":', str(R.error_types[status] or "api_error"),
                 ',"param":', param and str(param) or "null", ',"code":', str(code), "}}"})
end

-- A contract error (or any non-2xx body) in OpenAI's shape: the contract's own is kept.
local function responses_error(status, body)
  local doc = decode_all(body)
  if is_object(doc) and is_object(doc.error) then return body end
  return responses_error_body(status, format("the gateway answered %d", status), UPSTREAM_ERROR)
end

local function responses_usage(usage)
  local input, cached, output, reasoning = internal_usage(usage)
  if input == nil then return nil end
  return concat({'{"input_tokens":', format("%d", input), ',"input_tokens_details":{"cached_tokens":',
                 format("%d", cached), '},"output_tokens":', format("%d", output),
                 ',"output_tokens_details":{"reasoning_tokens":', format("%d", reasoning), '},"total_tokens":',
                 format("%d", input + output), "}"})
end

local function created_of(v)  -- a whole number of seconds, 0 when it is not one
  if type(v) == "number" and v == math.floor(v) and v > -1e15 and v < 1e15 then return format("%d", v) end
  return "0"
end

-- A chat completion's finish as the Response's status and, when incomplete, its reason.
local function responses_status(finish)
  local reason = type(finish) == "string" and R.incomplete[finish] or nil
  if reason then return "incomplete", reason end
  return "completed", nil
end

local function item_id(prefix, bare, index)
  return concat({prefix, "_", bare, "_", format("%d", index)})
end

local function reasoning_item(id, text)  -- text nil: the item as it opens, its summary still empty
  return concat({'{"type":"reasoning","id":', str(id), ',"summary":[',
                 text and ('{"type":"summary_text","text":' .. str(text) .. "}") or "", "]}"})
end

local function message_item(id, text)  -- text nil: the item as it opens
  return concat({'{"type":"message","id":', str(id), ',"status":', text and '"completed"' or '"in_progress"',
                 ',"role":"assistant","content":[',
                 text and ('{"type":"output_text","text":' .. str(text) .. ',"annotations":[]}') or "", "]}"})
end

-- A call to `ns__fn` where `ns` is one of the request's namespaces: `fn` in namespace `ns`.
local function call_item(id, call_id, name, arguments, status, namespaces)
  local namespace = ""
  local ns, fn = string.match(name, "^(.-)__(.+)$")
  if namespaces and ns and namespaces[ns] then
    name, namespace = fn, ',"namespace":' .. str(ns)
  end
  return concat({'{"type":"function_call","id":', str(id), ',"call_id":', str(call_id), ',"name":', str(name),
                 namespace, ',"arguments":', str(arguments), ',"status":"', status, '"}'})
end

local function responses_object(bare, created, model, status, items, usage, reason, err)
  return concat({'{"id":"resp_', bare, '","object":"response","created_at":', created, ',"status":"', status,
                 '","error":', err or "null", ',"incomplete_details":',
                 reason and ('{"reason":' .. str(reason) .. "}") or "null", ',"model":', str(model),
                 ',"output":[', concat(items, ","), '],"usage":', usage or "null", "}"})
end

-- An internal chat completion as a Response (its first choice: the Responses API has no `n`).
local function responses_answer(doc, namespaces)
  local id, model, choice, msg, text, calls = first_message(doc)
  if id == nil then return nil end
  local bare, items, reasoning = without_prefix(id), {}, reasoning_of(msg)
  if reasoning then items[#items + 1] = reasoning_item(item_id("rs", bare, #items), reasoning) end
  if text ~= "" then items[#items + 1] = message_item(item_id("msg", bare, #items), text) end
  for _, call in ipairs(calls) do
    local fn = is_object(call) and object_of(call["function"])
    local call_id, name, arguments = fn and text_of(call.id, ""), fn and text_of(fn.name, ""),
      fn and text_of(fn.arguments, "")
    if not (call_id and name and arguments) then return nil end
    items[#items + 1] = call_item(item_id("fc", bare, #items), call_id, name, arguments, "completed", namespaces)
  end
  local usage = responses_usage(doc.usage)
  if usage == nil then return nil end
  local status, reason = responses_status(choice.finish_reason)
  return responses_object(bare, created_of(doc.created), model, status, items, usage, reason, nil)
end

-- ---- the stream: the Responses API's events, each numbered (ResponsesStream in tests/oracles/) --------

local function responses_event(st, kind, fields)
  local out = concat({"event: ", kind, '\ndata: {"type":"', kind, '","sequence_number":', format("%d", st.seq),
                      fields ~= "" and "," or "", fields, "}\n\n"})
  st.seq = st.seq + 1
  return out
end

local function snapshot(st, status, reason, err)
  return responses_object(st.bare, st.created, st.model, status, st.output, st.usage, reason, err)
end

local function responses_start(st, id, created, model)
  st.started, st.bare, st.created, st.model = true, without_prefix(id), created, model
  return responses_event(st, "response.created", '"response":' .. snapshot(st, "in_progress"))
    .. responses_event(st, "response.in_progress", '"response":' .. snapshot(st, "in_progress"))
end

local function where(st)  -- the open item's place
  return concat({'"item_id":', str(st.item_id), ',"output_index":', format("%d", #st.output)})
end

local function responses_close(st, out)
  if st.open == nil then return end
  local kind, index, text = st.open, #st.output, concat(st.text)
  local at, item = where(st), nil
  st.open = nil
  if kind == "reasoning" then
    item = reasoning_item(st.item_id, text)
    out[#out + 1] = responses_event(st, "response.reasoning_summary_text.done",
                                    at .. ',"summary_index":0,"text":' .. str(text))
    out[#out + 1] = responses_event(st, "response.reasoning_summary_part.done", at
                                    .. ',"summary_index":0,"part":{"type":"summary_text","text":' .. str(text) .. "}")
  elseif kind == "message" then
    item = message_item(st.item_id, text)
    out[#out + 1] = responses_event(st, "response.output_text.done", at .. ',"content_index":0,"text":' .. str(text))
    out[#out + 1] = responses_event(st, "response.content_part.done", at
                                    .. ',"content_index":0,"part":{"type":"output_text","text":' .. str(text)
                                    .. ',"annotations":[]}')
  else
    item = call_item(st.item_id, st.call_id, st.call_name, text, "completed", st.namespaces)
    out[#out + 1] = responses_event(st, "response.function_call_arguments.done", at .. ',"arguments":' .. str(text))
  end
  st.output[#st.output + 1] = item
  out[#out + 1] = responses_event(st, "response.output_item.done", format('"output_index":%d,"item":', index) .. item)
end

local function responses_open(st, out, kind, prefix, call_id, name)
  responses_close(st, out)
  local index = #st.output
  st.open, st.item_id, st.text, st.call_id, st.call_name = kind, item_id(prefix, st.bare, index), {}, call_id, name
  local added = format('"output_index":%d,"item":', index)
  if kind == "reasoning" then
    out[#out + 1] = responses_event(st, "response.output_item.added", added .. reasoning_item(st.item_id, nil))
    out[#out + 1] = responses_event(st, "response.reasoning_summary_part.added", where(st)
                                    .. ',"summary_index":0,"part":{"type":"summary_text","text":""}')
  elseif kind == "message" then
    out[#out + 1] = responses_event(st, "response.output_item.added", added .. message_item(st.item_id, nil))
    out[#out + 1] = responses_event(st, "response.content_part.added", where(st)
                                    .. ',"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}')
  else
    out[#out + 1] = responses_event(st, "response.output_item.added", added
                                    .. call_item(st.item_id, call_id, name, "", "in_progress", st.namespaces))
  end
end

-- A delta of the open item `kind` (opened first, closing the one open).
local function responses_delta(st, out, kind, prefix, event, value, index_field)
  if st.open ~= kind then responses_open(st, out, kind, prefix, "", "") end
  st.text[#st.text + 1] = value
  out[#out + 1] = responses_event(st, event, where(st) .. (index_field and (',"' .. index_field .. '":0') or "")
                                  .. ',"delta":' .. str(value))
end

local function responses_begin(st, obj, out)
  if st.started then return true end
  local id, model = text_of(obj.id, ""), text_of(obj.model, "")
  if id == nil or model == nil then return false end
  out[#out + 1] = responses_start(st, id, created_of(obj.created), model)
  return true
end

local function responses_text(st, text, out)
  responses_delta(st, out, "message", "msg", "response.output_text.delta", text, "content_index")
end

local function responses_reasoning(st, text, out)
  responses_delta(st, out, "reasoning", "rs", "response.reasoning_summary_text.delta", text, "summary_index")
end

local function responses_signature() end  -- a provider's signature over its reasoning: not carried here

local function responses_call(st, n, call, fn, out)
  local key = "call" .. format("%d", n)
  if st.open ~= key then
    local call_id, name = text_of(call.id, ""), text_of(fn.name, "")
    if call_id == nil or name == nil then return false end
    responses_open(st, out, key, "fc", call_id, name)
  end
  local arguments = fn.arguments
  if type(arguments) == "string" and arguments ~= "" then
    responses_delta(st, out, key, "fc", "response.function_call_arguments.delta", arguments, nil)
  end
  return true
end

local function responses_finish(st, finish, _, out)
  responses_close(st, out)
  st.finish = finish
end

local function responses_done(st, out)
  if not st.started then out[#out + 1] = responses_start(st, "", "0", "") end
  responses_close(st, out)
  local status, reason = responses_status(st.finish)
  out[#out + 1] = responses_event(st, status == "completed" and "response.completed" or "response.incomplete",
                                  '"response":' .. snapshot(st, status, reason))
end

local function responses_error_event(message, st)
  local out = st.started and "" or responses_start(st, "", "0", "")
  return out .. responses_event(st, "response.failed", '"response":' .. snapshot(st, "failed", nil, concat({
    '{"code":', str(STREAM_INTERRUPTED), ',"message":', str(message), "}"})))
end

local function responses_stream()
  return {seq = 0, started = false, bare = "", created = "0", model = "", output = {}, open = nil, item_id = "",
          text = {}, call_id = "", call_name = "", finish = nil, usage = nil}
end

DOORS.responses = {answer = responses_answer, error = responses_error, error_body = responses_error_body,
                   stream = responses_stream, begin = responses_begin, usage = responses_usage,
                   text = responses_text, reasoning = responses_reasoning, signature = responses_signature,
                   call = responses_call, finish = responses_finish, done = responses_done,
                   error_event = responses_error_event}
