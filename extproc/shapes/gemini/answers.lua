-- Gemini's generateContent answers and streams, into the internal shape (the renderer puts this into extproc/lua/answers.lua, after its shared helpers).

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
    native_finish(cand.finishReason, finish)
  end
  local prompt, cached, output, reasoning_tokens = gemini_usage(meta)
  if prompt == nil then return nil end
  return completion(rid, named ~= "" and named or model, text, reasoning, calls, finish,
                    usage_json(prompt, cached, output, reasoning_tokens), refusal)
end

ANSWERS.gemini = gemini

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
    local finish = gemini_finish(reason, st.ncalls > 0)
    native_finish(reason, finish)
    out[#out + 1] = chunk(st, "{}", finish)
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

STREAMS.gemini = {reader = sse_reader(gemini_event), finish = gemini_end}
