-- The answer filter, in Envoy (LuaJIT): a request that ext_proc's decision translated for a lone
-- candidate of another API shape (extproc/direct.py) passes here, with no round trip to ext_proc, and
-- so does every answer of a plan's candidate of another shape, which the attempt filter
-- (extproc/attempts.py) names in headers of its own.
-- The renderer (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace and key names from
-- extproc/names.py, each shape's stop reasons from its adapter, the contract's 502 body and
-- `stream_interrupted` event) and extproc/lua/json.lua, sse.lua, values.lua and eventstream.lua.
--
-- - Request: the headers the provider's shape needs (`:path`, its key, its version header, Bedrock's
--   authority and signature), which the decision left in the request's metadata, are set - after the
--   header allow-list, which would drop them - and the metadata's copy is blanked, so the credential
--   reaches no access log.
-- - Answer: a 2xx answer is read whole and written as the internal chat completion (what the shape's
--   adapter in extproc/shapes/ makes of it), before json_to_metadata reads its usage for settlement;
--   one that does not parse or is not the shape's answer becomes the contract's 502 `upstream_error`.
--   A 2xx stream (Anthropic's and Gemini's SSE, Bedrock's AWS event stream: extproc/lua/eventstream.lua)
--   is translated chunk by chunk before the Lua stream guard reads it.
--   Error statuses pass: custom_response has already put them in the contract's shape. What the
--   translation lost is named in x-llmgw-translation-loss.

local concat, format, time = table.concat, string.format, os.time
local K, NS = CONFIG.keys, CONFIG.namespace

function envoy_on_request(h)
  local dm = h:streamInfo():dynamicMetadata()
  local md = dm:get(NS)
  local native = md and md[K.upstream_headers]
  if type(native) ~= "table" then return end
  local headers = h:headers()
  for name, value in pairs(native) do headers:replace(name, value) end
  dm:set(NS, K.upstream_headers, "")
end

-- The internal usage object's text (extproc/shapes/base.py `Usage.openai`).
local function usage_json(prompt, cached, output, reasoning)
  return concat({'{"prompt_tokens":', format("%d", prompt), ',"completion_tokens":', format("%d", output),
                 ',"total_tokens":', format("%d", prompt + output), ',"prompt_tokens_details":{"cached_tokens":',
                 format("%d", cached), "}",
                 reasoning > 0 and (',"completion_tokens_details":{"reasoning_tokens":' .. format("%d", reasoning) .. "}")
                   or "", "}"})
end

-- The internal chat completion's text. `text`, `reasoning`: lists of escaped string contents; `calls`:
-- tool calls as JSON; a `refusal` (escaped) leaves the content null.
local function completion(id, model, text, reasoning, calls, finish, usage, refusal)
  local message = {'{"role":"assistant","content":',
                   (refusal == nil and (#text > 0 or #calls == 0)) and ('"' .. concat(text) .. '"') or "null"}
  if refusal ~= nil then message[#message + 1] = ',"refusal":"' .. refusal .. '"' end
  if #reasoning > 0 then message[#message + 1] = ',"reasoning":"' .. concat(reasoning) .. '"' end
  if #calls > 0 then message[#message + 1] = ',"tool_calls":[' .. concat(calls, ",") .. "]" end
  message[#message + 1] = "}"
  return concat({'{"id":"chatcmpl-', id, '","object":"chat.completion","created":', format("%d", time()),
                 ',"model":"', model, '","choices":[{"index":0,"message":', concat(message),
                 ',"logprobs":null,"finish_reason":"', finish, '"}],"usage":', usage, "}"})
end

-- A tool call; its arguments the provider's JSON object as it wrote it (absent: `{}`), or nil when the
-- input is something else.
local function call_json(id, name, input, body)
  local args
  if absent(input) then
    args = "{}"
  elseif is_object(input) then
    local span = SPAN[input]
    args = as_string(sub(body, span[1], span[2]))
  else
    return nil
  end
  return '{"id":"' .. id .. '","type":"function","function":{"name":"' .. name .. '","arguments":"' .. args .. '"}}'
end

-- Anthropic's prompt tokens (cache reads and writes included) and cache reads, from a usage object
-- (extproc/shapes/anthropic/adapter.py `_usage`); nil when a count is not one.
local function anthropic_prompt(usage)
  local input, read, written = count(usage.input_tokens), count(usage.cache_read_input_tokens),
    count(usage.cache_creation_input_tokens)
  if input == nil or read == nil or written == nil then return nil end
  return input + read + written, read
end

-- Anthropic's Messages answer (extproc/shapes/anthropic/adapter.py `completion`).
local ANTHROPIC_STOP = CONFIG.anthropic_stop
local function anthropic(body, model)
  local doc = decode_all(body)
  if not is_object(doc) or doc.type ~= "message" then return nil end
  local id, named = text_of(doc.id, ""), text_of(doc.model, "")
  local content, usage = list_of(doc.content), object_of(doc.usage)
  if id == nil or named == nil or content == nil or usage == nil then return nil end
  local text, reasoning, calls = {}, {}, {}
  for _, block in ipairs(content) do
    if not is_object(block) then return nil end
    local kind = block.type
    if kind == "text" or kind == "thinking" then
      local t = text_of(block[kind], "")
      if t == nil then return nil end
      local into = kind == "text" and text or reasoning
      into[#into + 1] = t
    elseif kind == "tool_use" then
      if type(block.id) ~= "string" or type(block.name) ~= "string" then return nil end
      local call = call_json(block.id, block.name, block.input, body)
      if call == nil then return nil end
      calls[#calls + 1] = call
    end
  end
  local prompt, read = anthropic_prompt(usage)
  local output = count(usage.output_tokens)
  if prompt == nil or output == nil then return nil end
  local stop = type(doc.stop_reason) == "string" and ANTHROPIC_STOP[doc.stop_reason] or "stop"
  return completion(id, named ~= "" and named or model, text, reasoning, calls, stop,
                    usage_json(prompt, read, output, 0))
end

-- Gemini's usage (extproc/shapes/gemini/adapter.py `_usage`): prompt, cached input, output (thoughts
-- included) and reasoning tokens; nil when a count is not one.
local function gemini_usage(meta)
  local prompt, cached, output, thoughts = count(meta.promptTokenCount), count(meta.cachedContentTokenCount),
    count(meta.candidatesTokenCount), count(meta.thoughtsTokenCount)
  if prompt == nil or cached == nil or output == nil or thoughts == nil then return nil end
  return prompt, cached, output + thoughts, thoughts
end

-- The parts of a candidate's content; nil when the candidate is not one.
local function gemini_parts(cand)
  local content = is_object(cand) and object_of(cand.content)
  return content and list_of(content.parts) or nil
end

-- A functionCall part as the tool call `id`, its arguments a span of `source`; nil when it is not one.
local function gemini_call(fn, id, source)
  if not is_object(fn) or type(fn.name) ~= "string" then return nil end
  return call_json(id, fn.name, fn.args, source)
end

local GEMINI_FINISH = CONFIG.gemini_finish
local function gemini_finish(reason, called)
  local finish = type(reason) == "string" and GEMINI_FINISH[reason] or "stop"
  return (called and finish == "stop") and "tool_calls" or finish
end

-- Gemini's generateContent answer (extproc/shapes/gemini/adapter.py `completion`). A call without a response
-- id is named after the request's id.
local function gemini(body, model, request_id)
  local doc = decode_all(body)
  if not is_object(doc) or (doc.candidates == nil and doc.promptFeedback == nil) then return nil end
  local rid, named = text_of(doc.responseId, ""), text_of(doc.modelVersion, "")
  local candidates, meta = list_of(doc.candidates), object_of(doc.usageMetadata)
  if rid == nil or named == nil or candidates == nil or meta == nil then return nil end
  local text, reasoning, calls, finish, refusal = {}, {}, {}, "content_filter", nil
  if #candidates == 0 then  -- the prompt was blocked: no candidate at all
    local feedback = object_of(doc.promptFeedback)
    local reason = feedback and text_of(feedback.blockReason, "OTHER")
    if reason == nil then return nil end
    refusal = "the provider blocked the prompt (" .. reason .. ")"
  else
    local cand = candidates[1]
    local parts = gemini_parts(cand)
    if not parts then return nil end
    for _, part in ipairs(parts) do
      if not is_object(part) then return nil end
      if part.functionCall ~= nil then
        local named_after = rid ~= "" and rid or request_id
        local call = gemini_call(part.functionCall, "call_" .. named_after .. "_" .. #calls, body)
        if call == nil then return nil end
        calls[#calls + 1] = call
      elseif part.thought == true then
        local t = text_of(part.text, "")
        if t == nil then return nil end
        reasoning[#reasoning + 1] = t
      elseif part.text ~= nil then
        if type(part.text) ~= "string" then return nil end
        text[#text + 1] = part.text
      end
    end
    finish = gemini_finish(cand.finishReason, #calls > 0)
  end
  local prompt, cached, output, reasoning_tokens = gemini_usage(meta)
  if prompt == nil then return nil end
  return completion(rid, named ~= "" and named or model, text, reasoning, calls, finish,
                    usage_json(prompt, cached, output, reasoning_tokens), refusal)
end

-- Bedrock's usage (extproc/shapes/bedrock/adapter.py `_usage`): prompt tokens (cache reads and writes
-- included), cache reads, output; nil when its two counts are not there or a count is not one.
local function bedrock_usage(usage)
  if not is_object(usage) or type(usage.inputTokens) ~= "number" or type(usage.outputTokens) ~= "number" then
    return nil
  end
  local input, read, written, output = count(usage.inputTokens), count(usage.cacheReadInputTokens),
    count(usage.cacheWriteInputTokens), count(usage.outputTokens)
  if input == nil or read == nil or written == nil or output == nil then return nil end
  return input + read + written, read, output
end

-- Bedrock's Converse answer (extproc/shapes/bedrock/adapter.py `completion`), named after the request's id.
local BEDROCK_STOP = CONFIG.bedrock_stop
local function bedrock(body, model, request_id)
  local doc = decode_all(body)
  if not is_object(doc) or doc.output == nil then return nil end
  local message = is_object(doc.output) and doc.output.message
  local content = is_object(message) and message.content
  if not is_array(content) then return nil end
  local text, reasoning, calls = {}, {}, {}
  for _, block in ipairs(content) do
    if not is_object(block) then return nil end
    if block.text ~= nil then
      if type(block.text) ~= "string" then return nil end
      text[#text + 1] = block.text
    elseif block.toolUse ~= nil then
      local use = block.toolUse
      if not is_object(use) or type(use.toolUseId) ~= "string" or type(use.name) ~= "string" then return nil end
      local call = call_json(use.toolUseId, use.name, use.input, body)
      if call == nil then return nil end
      calls[#calls + 1] = call
    elseif block.reasoningContent ~= nil then
      local said = is_object(block.reasoningContent) and object_of(block.reasoningContent.reasoningText)
      local t = said and text_of(said.text, "")
      if not t then return nil end
      reasoning[#reasoning + 1] = t
    end
  end
  local prompt, read, output = bedrock_usage(doc.usage)
  if prompt == nil then return nil end
  local stop = type(doc.stopReason) == "string" and BEDROCK_STOP[doc.stopReason] or "stop"
  return completion(request_id, model, text, reasoning, calls, stop, usage_json(prompt, read, output, 0))
end

-- A hosted OpenAI-shaped server's answer is already the internal shape: checked, passed as it came.
local function openai(body)
  local doc = decode_all(body)
  if not is_object(doc) or not is_array(doc.choices) then return nil end
  return body
end

-- Anthropic's Messages stream, one event at a time (extproc/shapes/anthropic/adapter.py `AnthropicStream`):
-- each event's chunks are added to `out`; false when the event breaks the stream.
-- Every chunk's text up to its choices: made once per stream (again if message_start renames it).
local function chunk_head(st)
  if st.head == nil then
    st.head = concat({'data: {"id":"chatcmpl-', st.id, '","object":"chat.completion.chunk","created":',
                      st.created, ',"model":"', st.model, '","choices":'})
  end
  return st.head
end

local function chunk(st, delta, finish)
  return concat({chunk_head(st), '[{"index":0,"delta":', delta, ',"logprobs":null,"finish_reason":',
                 finish and ('"' .. finish .. '"') or "null", "}]}\n\n"})
end

local function anthropic_event(st, doc, out)
  if st.stopped then return false end  -- nothing may follow message_stop
  local kind = doc.type
  if kind == "message_start" then
    local msg = doc.message
    local usage = is_object(msg) and object_of(msg.usage)
    local named = is_object(msg) and text_of(msg.model, "")
    if not usage or not named or type(msg.id) ~= "string" then return false end
    local prompt, read = anthropic_prompt(usage)
    if prompt == nil then return false end
    st.id, st.prompt, st.cached, st.head = msg.id, prompt, read, nil
    if named ~= "" then st.model = named end
    out[#out + 1] = chunk(st, '{"role":"assistant","content":""}')
  elseif kind == "content_block_start" then
    local block = doc.content_block
    if not is_object(block) then return false end
    if block.type == "tool_use" then
      if type(doc.index) ~= "number" or type(block.id) ~= "string" or type(block.name) ~= "string" then
        return false
      end
      local n = st.ncalls
      st.calls[doc.index], st.ncalls = n, n + 1
      out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"id":"', block.id,
                                       '","type":"function","function":{"name":"', block.name, '","arguments":""}}]}'}))
    end
  elseif kind == "content_block_delta" then
    local delta = doc.delta
    if not is_object(delta) then return false end
    local dt = delta.type
    if dt == "text_delta" or dt == "thinking_delta" then
      local t = delta[dt == "text_delta" and "text" or "thinking"]
      if type(t) ~= "string" then return false end
      out[#out + 1] = chunk(st, (dt == "text_delta" and '{"content":"' or '{"reasoning":"') .. t .. '"}')
    elseif dt == "input_json_delta" then
      local n = type(doc.index) == "number" and st.calls[doc.index]
      if not n or type(delta.partial_json) ~= "string" then return false end
      out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"function":{"arguments":"',
                                       delta.partial_json, '"}}]}'}))
    end
  elseif kind == "message_delta" then
    local delta, usage = doc.delta, object_of(doc.usage)
    if not is_object(delta) or usage == nil then return false end
    local output = usage.output_tokens
    if not absent(output) and output ~= 0 then
      output = count(output)
      if output == nil then return false end
      st.output = output
    end
    st.finish = type(delta.stop_reason) == "string" and ANTHROPIC_STOP[delta.stop_reason] or "stop"
    out[#out + 1] = chunk(st, "{}", st.finish)
  elseif kind == "message_stop" then
    st.stopped = true
    out[#out + 1] = concat({chunk_head(st), '[],"usage":', usage_json(st.prompt, st.cached, st.output, 0),
                            "}\n\n", "data: [DONE]\n\n"})
  elseif kind == "error" then
    return false
  end
  return true  -- ping, content_block_stop, and what the API adds later: nothing to carry
end

-- The end of an Anthropic stream: message_stop has said it all; before it, the stream broke.
local function anthropic_end(st, out)
  return st.stopped
end

-- One response of Gemini's stream (extproc/shapes/gemini/adapter.py `GeminiStream`): each holds the next
-- parts of its first candidate, the usage so far, and at last a finish reason; nothing may follow that.
-- A call arrives whole (its id named after the response id, or the request's, as in the JSON answer).
local function gemini_event(st, doc, out)
  if st.stopped or doc.error ~= nil then return false end
  if not st.started then
    local rid, named = text_of(doc.responseId, ""), text_of(doc.modelVersion, "")
    if rid == nil or named == nil then return false end
    st.started, st.id, st.head = true, rid, nil
    st.calls_named = rid ~= "" and rid or st.request_id
    if named ~= "" then st.model = named end
    out[#out + 1] = chunk(st, '{"role":"assistant","content":""}')
  end
  local meta, candidates = object_of(doc.usageMetadata), list_of(doc.candidates)
  if meta == nil or candidates == nil then return false end
  if next(meta) ~= nil then
    local prompt, cached, output, reasoning = gemini_usage(meta)
    if prompt == nil then return false end
    st.prompt, st.cached, st.output, st.reasoning = prompt, cached, output, reasoning
  end
  if #candidates == 0 then
    local feedback = object_of(doc.promptFeedback)
    if feedback == nil then return false end
    if not absent(feedback.blockReason) and feedback.blockReason ~= "" then  -- the prompt was blocked
      st.stopped = true
      out[#out + 1] = chunk(st, '{"refusal":"the provider blocked the prompt"}', "content_filter")
    end
    return true
  end
  local cand = candidates[1]
  local parts = gemini_parts(cand)
  if not parts then return false end
  for _, part in ipairs(parts) do
    if not is_object(part) then return false end
    if part.functionCall ~= nil then
      local call = gemini_call(part.functionCall, "call_" .. st.calls_named .. "_" .. st.ncalls, st.data)
      if call == nil then return false end
      out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", st.ncalls), ",", sub(call, 2), "]}"}))
      st.ncalls = st.ncalls + 1
    elseif part.thought == true then
      local t = text_of(part.text, "")
      if t == nil then return false end
      out[#out + 1] = chunk(st, '{"reasoning":"' .. t .. '"}')
    elseif not absent(part.text) then
      if type(part.text) ~= "string" then return false end
      if part.text ~= "" then out[#out + 1] = chunk(st, '{"content":"' .. part.text .. '"}') end
    end
  end
  local reason = cand.finishReason
  if not absent(reason) and reason ~= "" then
    st.stopped = true
    out[#out + 1] = chunk(st, "{}", gemini_finish(reason, st.ncalls > 0))
  end
  return true
end

-- The end of a Gemini stream, which has no event of its own: once a response finished, the usage and
-- [DONE] ride on the stream's last (empty) frame; without a finish, the stream broke.
local function gemini_end(st, out)
  if not st.stopped then return false end
  out[#out + 1] = concat({chunk_head(st), '[],"usage":', usage_json(st.prompt, st.cached, st.output, st.reasoning),
                          "}\n\n", "data: [DONE]\n\n"})
  return true
end

-- Bedrock's ConverseStream, one event at a time (extproc/shapes/bedrock/adapter.py `BedrockStream`): a tool
-- call's input arrives as pieces of JSON and leaves as argument deltas of its call index; the usage
-- and [DONE] come with the metadata event, after messageStop, and nothing may follow it. Its chunks
-- are named after the request's id.
local function bedrock_event(st, kind, doc, out)
  if st.ended then return false end
  st.id = st.request_id
  if kind == "messageStart" then
    out[#out + 1] = chunk(st, '{"role":"assistant","content":""}')
  elseif kind == "contentBlockStart" then
    local use = is_object(doc.start) and doc.start.toolUse
    if not is_object(use) or type(use.toolUseId) ~= "string" or type(use.name) ~= "string"
        or type(doc.contentBlockIndex) ~= "number" then
      return false
    end
    local n = st.ncalls
    st.calls[doc.contentBlockIndex], st.ncalls = n, n + 1
    out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"id":"', use.toolUseId,
                                     '","type":"function","function":{"name":"', use.name, '","arguments":""}}]}'}))
  elseif kind == "contentBlockDelta" then
    local delta = doc.delta
    if not is_object(delta) then return false end
    if delta.text ~= nil then
      if type(delta.text) ~= "string" then return false end
      out[#out + 1] = chunk(st, '{"content":"' .. delta.text .. '"}')
    elseif delta.toolUse ~= nil then
      local n = type(doc.contentBlockIndex) == "number" and st.calls[doc.contentBlockIndex]
      local use = delta.toolUse
      if not n or not is_object(use) or type(use.input) ~= "string" then return false end
      out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"function":{"arguments":"',
                                       use.input, '"}}]}'}))
    elseif delta.reasoningContent ~= nil then
      local said = is_object(delta.reasoningContent) and delta.reasoningContent
      local t = said and text_of(said.text, "")
      if not t then return false end
      out[#out + 1] = chunk(st, '{"reasoning":"' .. t .. '"}')
    end
  elseif kind == "messageStop" then
    st.stopped = true
    out[#out + 1] = chunk(st, "{}", type(doc.stopReason) == "string" and BEDROCK_STOP[doc.stopReason] or "stop")
  elseif kind == "metadata" then
    if not st.stopped then return false end
    local prompt, read, output = bedrock_usage(doc.usage)
    if prompt == nil then return false end
    st.ended = true
    out[#out + 1] = concat({chunk_head(st), '[],"usage":', usage_json(prompt, read, output, 0), "}\n\n",
                            "data: [DONE]\n\n"})
  end
  return true  -- contentBlockStop, and what the API adds later: nothing to carry
end

-- The end of a Bedrock stream: the metadata event said it all, and no message was left half-sent.
local function bedrock_end(st, out, held)
  return st.ended and held == 0
end

-- Each stream shape's reader, made once per stream: `read(st, bytes, out)` handles the chunk's whole
-- events (their chunks added to `out`) and returns true and how many bytes of an event still arriving
-- it holds, or false when an event breaks the stream. The work is linear in the bytes received (an
-- answer of a million events in one write is read once). SSE events (Anthropic's, Gemini's): an event
-- without data is a comment, passed over.
local function sse_reader(event)
  return function()
    local split = event_splitter()
    return function(st, bytes, out)
      local events = {}
      local held = split(bytes, events)
      for _, whole in ipairs(events) do
        local data = event_data(whole)
        if data ~= nil then
          local doc = decode_all(data)
          st.data = data  -- (a call's arguments are a span of it)
          if not is_object(doc) or not event(st, doc, out) then return false end
        end
      end
      return true, held
    end
  end
end

-- AWS event-stream messages (Bedrock's), read at an offset and what was read dropped once per chunk:
-- an exception message (throttling, ...) breaks the stream.
local function bedrock_reader()
  local pending = ""
  return function(st, bytes, out)
    pending = pending .. bytes
    local at = 1
    while true do
      local headers, payload, length = eventstream_message(pending, CONFIG.max_event_bytes, at)
      if headers == nil then break end
      if not headers or headers[":message-type"] ~= "event" then return false end
      local doc = decode_all(payload ~= "" and payload or "{}")
      if not is_object(doc) or not bedrock_event(st, headers[":event-type"] or "", doc, out) then return false end
      at = at + length
    end
    if at > 1 then pending = sub(pending, at) end
    return true, #pending
  end
end

-- A 2xx stream of a shape translated here: every chunk's complete events translated as they come (the
-- start of one still arriving is held back); at a break - an event that does not parse or breaks the
-- shape, one over the size bound, an end the shape's own `finish` does not accept - what was
-- translated, then the contract's `stream_interrupted` event, and nothing after it. A chunk that
-- completes no event passes as an SSE comment: an empty chunk would read as the stream's end to the
-- stream guard after this.
local function translate_stream(h, model, request_id, shape)
  local st = {id = "", model = model, request_id = request_id, created = format("%d", time()), calls = {},
              ncalls = 0, prompt = 0, cached = 0, output = 0, reasoning = 0, stopped = false, started = false,
              ended = false}
  local read, finish = shape.reader(), shape.finish
  rewrite_chunks(h, function(bytes, at_end)
    local out = {}
    local ok, held = read(st, bytes, out)
    local broken = not ok or held > CONFIG.max_event_bytes or (at_end and not finish(st, out, held))
    if broken then out[#out + 1] = CONFIG.interrupted end
    local text = concat(out)
    return (text == "" and not at_end) and CONFIG.keepalive or text, broken
  end)
end

-- The dispatch: the shapes the registry (extproc/shapes/registry.py) says this filter translates, each to its
-- translator here. A shape registered without one stops the filter from loading, so Envoy refuses the
-- bootstrap instead of passing that shape's answers untranslated.
local ANSWERS = {anthropic = anthropic, gemini = gemini, bedrock = bedrock, openai = openai}
local STREAMS = {anthropic = {reader = sse_reader(anthropic_event), finish = anthropic_end},
                 gemini = {reader = sse_reader(gemini_event), finish = gemini_end},
                 bedrock = {reader = bedrock_reader, finish = bedrock_end}}
local TRANSLATE, TRANSLATE_STREAM = {}, {}
for _, shape in ipairs(CONFIG.answer_shapes) do
  TRANSLATE[shape] = ANSWERS[shape] or error("the answer filter has no translator for the shape " .. shape)
end
for _, shape in ipairs(CONFIG.stream_shapes) do
  TRANSLATE_STREAM[shape] = STREAMS[shape] or error("the answer filter has no stream translator for " .. shape)
end

-- Which shape to read the answer as, and the model it names when the shape names none: the decision's
-- (a lone candidate it translated for, in the metadata), else the attempt filter's (a plan's candidate
-- of another shape answered: the headers it set, which never reach the client - nor do an upstream's
-- own of those names: the attempt filter removes them, and so does this).
local function answer_of(headers, md)
  local shape, model = headers:get(CONFIG.shape_header), headers:get(CONFIG.model_header)
  headers:remove(CONFIG.shape_header)
  headers:remove(CONFIG.model_header)
  if md[K.answer_shape] ~= nil then
    local lost = md[K.translation_loss]
    if lost ~= nil and lost ~= "" then headers:replace(CONFIG.loss_header, lost) end
    return md[K.answer_shape], md[K.answer_model]
  end
  return shape, model
end

function envoy_on_response(h)
  local md = h:streamInfo():dynamicMetadata():get(NS) or {}
  local headers = h:headers()
  local shape, model = answer_of(headers, md)
  local translate = shape and TRANSLATE[shape]
  if translate == nil then return end
  model = model or ""
  local status = tonumber(headers:get(":status")) or 0
  if status < 200 or status >= 300 then return end
  -- Envoy's own degraded answer (every upstream was down): the gateway wrote it, in the internal shape.
  if headers:get(CONFIG.degraded_header) == "response" then return end
  if md[K.plan_stream] == "1" then
    -- A stream: an OpenAI-shaped one passes as it comes (the stream guard checks it).
    local stream = TRANSLATE_STREAM[shape]
    if stream == nil then return end
    headers:remove("content-length")
    headers:replace("content-type", "text/event-stream")
    translate_stream(h, model, md[K.request_id] or "", stream)
    return
  end
  local body = h:body()
  local out = body and translate(body:getBytes(0, body:length()), model, md[K.request_id] or "")
  headers = h:headers()  -- the handle taken before the body was read is out of scope now
  headers:replace("content-type", "application/json")
  if out == nil then
    headers:replace(":status", "502")
    out = CONFIG.broken
    h:streamInfo():dynamicMetadata():set(NS, K.answer_broken, "1")  -- settlement: charged, never released
  end
  if body then body:setBytes(out) end
end
