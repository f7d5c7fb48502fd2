-- The Gemini door's answers, streams and errors (the renderer puts this into extproc/lua/doors.lua).

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

-- The answer's tokens as `candidatesTokenCount`, the thoughts' apart (`thoughtsTokenCount`), as Gemini
-- counts them.
local function gemini_usage(usage)
  local input, cached, output, reasoning = internal_usage(usage)
  if input == nil then return nil end
  return concat({'{"promptTokenCount":', format("%d", input), ',"candidatesTokenCount":',
                 format("%d", output - reasoning), ',"totalTokenCount":', format("%d", input + output),
                 cached > 0 and (',"cachedContentTokenCount":' .. format("%d", cached)) or "",
                 reasoning > 0 and (',"thoughtsTokenCount":' .. format("%d", reasoning)) or "", "}"})
end

local function thought_part(text)
  return '{"text":' .. str(text) .. ',"thought":true}'
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
    local parts, reasoning = {}, reasoning_of(msg)
    if reasoning then parts[1] = thought_part(reasoning) end
    if text ~= "" then parts[#parts + 1] = '{"text":' .. str(text) .. "}" end
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

local function gemini_reasoning(st, text, out)
  out[#out + 1] = gemini_response(st, thought_part(text))
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

-- A token count (countTokens) in Gemini's shape.
local function gemini_count(n)
  return concat({'{"totalTokens":', n, ',"promptTokensDetails":[{"modality":"TEXT","tokenCount":', n, "}]}"})
end

DOORS.gemini = {answer = gemini_answer, count = gemini_count, error = gemini_error, error_body = gemini_error_body,
            stream = gemini_stream, begin = gemini_begin, usage = gemini_usage, text = gemini_text,
            reasoning = gemini_reasoning, signature = function() end,  -- (Gemini's thoughts carry none)
            call = gemini_call_delta, finish = gemini_finish_choice, done = gemini_done,
            error_event = gemini_error_event}
