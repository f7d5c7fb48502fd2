-- The answer filter, in Envoy (LuaJIT): a request that ext_proc's decision translated for a lone
-- candidate of another API shape (extproc/direct.py) passes here, with no round trip to ext_proc, and
-- so does every answer of a plan's candidate of another shape, which the attempt filter
-- (extproc/service/attempts.py) names in headers of its own.
-- The renderer (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace and key names from
-- extproc/names.py, each shape's stop reasons from its adapter, the contract's 502 body and
-- `stream_interrupted` event) and extproc/lua/json.lua, sse.lua, values.lua and eventstream.lua, and
-- puts each registered shape's translators (extproc/shapes/<shape>/answers.lua) where `@shapes` stands.
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

-- The internal usage object's text (extproc/settlement/charge.py `token_classes` prices it): `prompt` counts
-- every input token (the cache's reads, `cached`, and writes among them), `output` every output token
-- (`reasoning` among them). Cache writes are apart from reads: `writes` at the 5-minute (or only) rate,
-- `writes_1h` at the 1-hour rate, each priced on its own.
local function usage_json(prompt, cached, output, reasoning, writes, writes_1h)
  writes, writes_1h = writes or 0, writes_1h or 0
  return concat({'{"prompt_tokens":', format("%d", prompt), ',"completion_tokens":', format("%d", output),
                 ',"total_tokens":', format("%d", prompt + output), ',"prompt_tokens_details":{"cached_tokens":',
                 format("%d", cached),
                 writes > 0 and (',"cache_write_tokens":' .. format("%d", writes)) or "",
                 writes_1h > 0 and (',"cache_write_1h_tokens":' .. format("%d", writes_1h)) or "", "}",
                 reasoning > 0 and (',"completion_tokens_details":{"reasoning_tokens":' .. format("%d", reasoning) .. "}")
                   or "", "}"})
end

-- The internal chat completion's text. `text`, `reasoning`: lists of escaped string contents; `calls`:
-- tool calls as JSON; a `refusal` (escaped) leaves the content null.
-- `stop` (a JSON string's text, or nil): the stop sequence that ended the text, as vLLM's `stop_reason`.
-- `signature` (escaped, or nil): the provider's signature over the reasoning (`reasoning_signature`).
local function completion(id, model, text, reasoning, calls, finish, usage, refusal, stop, signature)
  local message = {'{"role":"assistant","content":',
                   (refusal == nil and (#text > 0 or #calls == 0)) and ('"' .. concat(text) .. '"') or "null"}
  if refusal ~= nil then message[#message + 1] = ',"refusal":"' .. refusal .. '"' end
  if #reasoning > 0 then message[#message + 1] = ',"reasoning":"' .. concat(reasoning) .. '"' end
  if signature ~= nil then message[#message + 1] = ',"reasoning_signature":"' .. signature .. '"' end
  if #calls > 0 then message[#message + 1] = ',"tool_calls":[' .. concat(calls, ",") .. "]" end
  message[#message + 1] = "}"
  return concat({'{"id":"chatcmpl-', id, '","object":"chat.completion","created":', format("%d", time()),
                 ',"model":"', model, '","choices":[{"index":0,"message":', concat(message),
                 ',"logprobs":null,"finish_reason":"', finish, '"', stop and (',"stop_reason":"' .. stop .. '"') or "",
                 '}],"usage":', usage, "}"})
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

-- Every chunk's text up to its choices: made once per stream (again if message_start renames it).
local function chunk_head(st)
  if st.head == nil then
    st.head = concat({'data: {"id":"chatcmpl-', st.id, '","object":"chat.completion.chunk","created":',
                      st.created, ',"model":"', st.model, '","choices":'})
  end
  return st.head
end

local function chunk(st, delta, finish, stop)
  return concat({chunk_head(st), '[{"index":0,"delta":', delta, ',"logprobs":null,"finish_reason":',
                 finish and ('"' .. finish .. '"') or "null", stop and (',"stop_reason":"' .. stop .. '"') or "",
                 "}]}\n\n"})
end

-- A stream's tool call opening at the shape's block `at` (Anthropic's index, Bedrock's
-- contentBlockIndex): the next call index, kept for the block's argument deltas, and its first chunk.
local function open_call(st, at, id, name)
  local n = st.ncalls
  st.calls[at], st.ncalls = n, n + 1
  return chunk(st, concat({'{"tool_calls":[{"index":', format("%d", n), ',"id":"', id,
                           '","type":"function","function":{"name":"', name, '","arguments":""}}]}'}))
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

-- Each shape's translators, by shape name: its answer's (body, model, request id) -> the internal
-- chat completion's text, or nil; its stream's {reader, finish}.
local ANSWERS, STREAMS = {}, {}

-- The finish reason as the provider wrote it and as the internal shape names it (a shape's translator
-- calls native_finish as it maps one to the other); the filter moves them into the request's metadata
-- right after each translation, so the ledger keeps both. (A translation never yields: no other
-- request runs in between.)
local NATIVE = {}
local function native_finish(reason, normalised)
  if type(reason) == "string" and #reason <= 64 and not find(reason, '[^%w_%-%.]') then
    NATIVE.finish, NATIVE.normal = reason, normalised
  end
end

-- @shapes

-- A 2xx stream of a shape translated here: every chunk's complete events translated as they come (the
-- start of one still arriving is held back); at a break - an event that does not parse or breaks the
-- shape, one over the size bound, an end the shape's own `finish` does not accept - what was
-- translated, then the contract's `stream_interrupted` event, and nothing after it. A chunk that
-- completes no event passes as an SSE comment: an empty chunk would read as the stream's end to the
-- stream guard after this.
local function native_to_metadata(h)
  if NATIVE.finish ~= nil or NATIVE.normal ~= nil then
    local dm = h:streamInfo():dynamicMetadata()
    if NATIVE.finish ~= nil then dm:set(NS, K.native_finish_reason, NATIVE.finish) end
    if NATIVE.normal ~= nil then dm:set(NS, K.finish_reason, NATIVE.normal) end
    NATIVE.finish, NATIVE.normal = nil, nil
  end
end

local function translate_stream(h, model, request_id, shape)
  local st = {id = "", model = model, request_id = request_id, created = format("%d", time()), calls = {},
              ncalls = 0, prompt = 0, cached = 0, output = 0, reasoning = 0, stopped = false, started = false,
              ended = false}
  local read, finish = shape.reader(), shape.finish
  rewrite_chunks(h, function(bytes, at_end)
    local out = {}
    local ok, held = read(st, bytes, out)
    native_to_metadata(h)
    local broken = not ok or held > CONFIG.max_event_bytes or (at_end and not finish(st, out, held))
    if broken then out[#out + 1] = CONFIG.interrupted end
    local text = concat(out)
    return (text == "" and not at_end) and CONFIG.keepalive or text, broken
  end)
end

-- The dispatch: the shapes the registry (extproc/shapes/registry.py) says this filter translates, each to
-- the translator its folder's answers.lua put in ANSWERS and STREAMS. A shape registered without one
-- stops the filter from loading, so Envoy refuses the bootstrap instead of passing that shape's answers
-- untranslated.
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
  native_to_metadata(h)
  headers = h:headers()  -- the handle taken before the body was read is out of scope now
  headers:replace("content-type", "application/json")
  if out == nil then
    headers:replace(":status", "502")
    headers:replace(CONFIG.should_retry_header, "false")  -- the provider did the work: a retry pays again
    out = CONFIG.broken
    h:streamInfo():dynamicMetadata():set(NS, K.answer_broken, "1")  -- settlement: charged, never released
  end
  if body then body:setBytes(out) end
end
