-- Bedrock's Converse answers and ConverseStream streams, into the internal shape (the renderer puts this into extproc/lua/answers.lua, after its shared helpers).

-- Bedrock's usage: prompt tokens (cache reads and writes included), cache reads, output, cache writes;
-- nil when its two counts are not there or a count is not one.
local function bedrock_usage(usage)
  if not is_object(usage) or type(usage.inputTokens) ~= "number" or type(usage.outputTokens) ~= "number" then
    return nil
  end
  local input, read, written, output = count(usage.inputTokens), count(usage.cacheReadInputTokens),
    count(usage.cacheWriteInputTokens), count(usage.outputTokens)
  if input == nil or read == nil or written == nil or output == nil then return nil end
  return input + read + written, read, output, written
end

-- The stop sequence that ended the text (its JSON text): Converse names it only in the model family's
-- own fields, which the adapter asks for (`additionalModelResponseFieldPaths`).
local function bedrock_stop_sequence(doc)
  local extra = doc.additionalModelResponseFields
  return doc.stopReason == "stop_sequence" and is_object(extra) and text_of(extra.stop_sequence, nil) or nil
end

-- Bedrock's Converse answer (extproc/shapes/bedrock/adapter.py `completion`), named after the request's id.
-- A call of the adapter's OUTPUT_TOOL (a response_format schema, asked for as a tool) is the answer's
-- content: its input, the JSON the schema describes; the stop for it is the answer's end.
local BEDROCK_STOP, OUTPUT_TOOL = CONFIG.bedrock_stop, CONFIG.bedrock_output.tool
local function bedrock_finish(reason, calls)
  if reason == "tool_use" and calls == 0 then return "stop" end
  return type(reason) == "string" and BEDROCK_STOP[reason] or "stop"
end
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
      if use.name == OUTPUT_TOOL then  -- (an input cut by max_tokens comes as the text written so far)
        if is_object(use.input) then
          local span = SPAN[use.input]
          text[#text + 1] = as_string(sub(body, span[1], span[2]))
        elseif type(use.input) == "string" then
          text[#text + 1] = use.input
        elseif not absent(use.input) then
          return nil
        end
      else
        local call = call_json(use.toolUseId, use.name, use.input, body)
        if call == nil then return nil end
        calls[#calls + 1] = call
      end
    elseif block.reasoningContent ~= nil then
      local said = is_object(block.reasoningContent) and object_of(block.reasoningContent.reasoningText)
      local t = said and text_of(said.text, "")
      if not t then return nil end
      reasoning[#reasoning + 1] = t
    end
  end
  local prompt, read, output, writes = bedrock_usage(doc.usage)
  if prompt == nil then return nil end
  local stop = bedrock_finish(doc.stopReason, #calls)
  native_finish(doc.stopReason, stop)
  return completion(request_id, model, text, reasoning, calls, stop, usage_json(prompt, read, output, 0, writes), nil,
                    bedrock_stop_sequence(doc))
end

ANSWERS.bedrock = bedrock

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
    if use.name == OUTPUT_TOOL then  -- the answer itself: its input arrives as the content
      st.output_block = doc.contentBlockIndex
    else
      out[#out + 1] = open_call(st, doc.contentBlockIndex, use.toolUseId, use.name)
    end
  elseif kind == "contentBlockDelta" then
    local delta = doc.delta
    if not is_object(delta) then return false end
    if delta.text ~= nil then
      if type(delta.text) ~= "string" then return false end
      out[#out + 1] = chunk(st, '{"content":"' .. delta.text .. '"}')
    elseif delta.toolUse ~= nil then
      local n = type(doc.contentBlockIndex) == "number" and st.calls[doc.contentBlockIndex]
      local use = delta.toolUse
      if not is_object(use) or type(use.input) ~= "string" then return false end
      if doc.contentBlockIndex ~= nil and doc.contentBlockIndex == st.output_block then
        out[#out + 1] = chunk(st, '{"content":"' .. use.input .. '"}')
      elseif not n then
        return false
      else
        out[#out + 1] = chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"function":{"arguments":"',
                                         use.input, '"}}]}'}))
      end
    elseif delta.reasoningContent ~= nil then
      local said = is_object(delta.reasoningContent) and delta.reasoningContent
      local t = said and text_of(said.text, "")
      if not t then return false end
      out[#out + 1] = chunk(st, '{"reasoning":"' .. t .. '"}')
    end
  elseif kind == "messageStop" then
    st.stopped = true
    local stop = bedrock_finish(doc.stopReason, st.ncalls)
    native_finish(doc.stopReason, stop)
    out[#out + 1] = chunk(st, "{}", stop, bedrock_stop_sequence(doc))
  elseif kind == "metadata" then
    if not st.stopped then return false end
    local prompt, read, output, writes = bedrock_usage(doc.usage)
    if prompt == nil then return false end
    st.ended = true
    out[#out + 1] = concat({chunk_head(st), '[],"usage":', usage_json(prompt, read, output, 0, writes), "}\n\n",
                            "data: [DONE]\n\n"})
  end
  return true  -- contentBlockStop, and what the API adds later: nothing to carry
end

-- The end of a Bedrock stream: the metadata event said it all, and no message was left half-sent.
local function bedrock_end(st, out, held)
  return st.ended and held == 0
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

STREAMS.bedrock = {reader = bedrock_reader, finish = bedrock_end}
