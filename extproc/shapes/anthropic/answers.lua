-- Anthropic's Messages answers and streams, into the internal shape (the renderer puts this into extproc/lua/answers.lua, after its shared helpers).

-- Anthropic's input from a usage object: prompt tokens (cache reads and writes included), cache reads,
-- writes at the 5-minute rate and at the 1-hour rate (`cache_creation` splits the writes by their TTL;
-- without it every write is a 5-minute one); nil when a count is not one or the split exceeds the writes.
local function anthropic_input(usage)
  local input, read, written = count(usage.input_tokens), count(usage.cache_read_input_tokens),
    count(usage.cache_creation_input_tokens)
  local split = object_of(usage.cache_creation)
  if input == nil or read == nil or written == nil or split == nil then return nil end
  local hour = count(split.ephemeral_1h_input_tokens)
  if hour == nil or hour > written then return nil end
  return input + read + written, read, written - hour, hour
end

-- The stop sequence that ended the text (its JSON text), carried as vLLM carries it.
local function stop_sequence(reason, sequence)
  return reason == "stop_sequence" and text_of(sequence, nil) or nil
end

-- Anthropic's Messages answer (extproc/shapes/anthropic/adapter.py `completion`).
local ANTHROPIC_STOP = CONFIG.anthropic_stop
local function anthropic(body, model)
  local doc = decode_all(body)
  if not is_object(doc) or doc.type ~= "message" then return nil end
  local id, named = text_of(doc.id, ""), text_of(doc.model, "")
  local content, usage = list_of(doc.content), object_of(doc.usage)
  if id == nil or named == nil or content == nil or usage == nil then return nil end
  local text, reasoning, calls, signature, thoughts = {}, {}, {}, nil, 0
  for _, block in ipairs(content) do
    if not is_object(block) then return nil end
    local kind = block.type
    if kind == "text" or kind == "thinking" then
      local t = text_of(block[kind], "")
      if t == nil then return nil end
      local into = kind == "text" and text or reasoning
      into[#into + 1] = t
      if kind == "thinking" then  -- its signature is carried for one block (a replay needs it whole)
        thoughts = thoughts + 1
        signature = thoughts == 1 and text_of(block.signature, nil) or nil
      end
    elseif kind == "tool_use" then
      if type(block.id) ~= "string" or type(block.name) ~= "string" then return nil end
      local call = call_json(block.id, block.name, block.input, body)
      if call == nil then return nil end
      calls[#calls + 1] = call
    end
  end
  local prompt, read, writes, writes_1h = anthropic_input(usage)
  local output = count(usage.output_tokens)
  if prompt == nil or output == nil then return nil end
  local stop = type(doc.stop_reason) == "string" and ANTHROPIC_STOP[doc.stop_reason] or "stop"
  native_finish(doc.stop_reason, stop)
  return completion(id, named ~= "" and named or model, text, reasoning, calls, stop,
                    usage_json(prompt, read, output, 0, writes, writes_1h), nil,
                    stop_sequence(doc.stop_reason, doc.stop_sequence),
                    signature)
end

ANSWERS.anthropic = anthropic

-- Anthropic's Messages stream, one event at a time (extproc/shapes/anthropic/adapter.py `AnthropicStream`):
-- each event's chunks are added to `out`; false when the event breaks the stream.
local function anthropic_event(st, doc, out)
  if st.stopped then return false end  -- nothing may follow message_stop
  local kind = doc.type
  if kind == "message_start" then
    local msg = doc.message
    local usage = is_object(msg) and object_of(msg.usage)
    local named = is_object(msg) and text_of(msg.model, "")
    if not usage or not named or type(msg.id) ~= "string" then return false end
    local prompt, read, writes, writes_1h = anthropic_input(usage)
    if prompt == nil then return false end
    st.id, st.prompt, st.cached, st.writes, st.writes_1h, st.head = msg.id, prompt, read, writes, writes_1h, nil
    if named ~= "" then st.model = named end
    out[#out + 1] = chunk(st, '{"role":"assistant","content":""}')
  elseif kind == "content_block_start" then
    local block = doc.content_block
    if not is_object(block) then return false end
    if block.type == "tool_use" then
      if type(doc.index) ~= "number" or type(block.id) ~= "string" or type(block.name) ~= "string" then
        return false
      end
      out[#out + 1] = open_call(st, doc.index, block.id, block.name)
    end
  elseif kind == "content_block_delta" then
    local delta = doc.delta
    if not is_object(delta) then return false end
    local dt = delta.type
    if dt == "text_delta" or dt == "thinking_delta" then
      local t = delta[dt == "text_delta" and "text" or "thinking"]
      if type(t) ~= "string" then return false end
      out[#out + 1] = chunk(st, (dt == "text_delta" and '{"content":"' or '{"reasoning":"') .. t .. '"}')
    elseif dt == "signature_delta" then
      if type(delta.signature) ~= "string" then return false end
      out[#out + 1] = chunk(st, '{"reasoning_signature":"' .. delta.signature .. '"}')
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
    if not absent(usage.input_tokens) then
      -- The input counts again, cumulative (as the API sends them now): they replace message_start's.
      local prompt, read, writes, writes_1h = anthropic_input(usage)
      if prompt == nil then return false end
      st.prompt, st.cached, st.writes, st.writes_1h = prompt, read, writes, writes_1h
    end
    st.finish = type(delta.stop_reason) == "string" and ANTHROPIC_STOP[delta.stop_reason] or "stop"
    native_finish(delta.stop_reason, st.finish)
    out[#out + 1] = chunk(st, "{}", st.finish, stop_sequence(delta.stop_reason, delta.stop_sequence))
  elseif kind == "message_stop" then
    st.stopped = true
    out[#out + 1] = concat({chunk_head(st), '[],"usage":',
                            usage_json(st.prompt, st.cached, st.output, 0, st.writes, st.writes_1h),
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

STREAMS.anthropic = {reader = sse_reader(anthropic_event), finish = anthropic_end}
