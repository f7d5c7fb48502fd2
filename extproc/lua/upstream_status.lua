-- Nearest the router (LuaJIT in Envoy), the first filter an answer passes: the renderer
-- (llmgw/render/filters.py) prepends `CONFIG` (the metadata namespace, the io.llmgw key names from
-- extproc/names.py, the contract's refusals and the provider request-id headers) and
-- extproc/lua/json.lua and extproc/lua/values.lua.
--
-- - The status of the answer's headers as the upstream sent them goes into the request's metadata,
--   before any other filter (custom_response, a Lua translation, a buffer that overflows) changes or
--   replaces them; settlement reads it (extproc/settlement/charge.py). Only the first status is kept: Envoy's
--   own reply after them (a body too large to read) passes here too. With it, the upstream's own
--   request id, for the ledger.
-- - An upstream that refused an admitted request as invalid (400, 422) or too large (413) said why,
--   and the caller needs the reason to fix its request: the contract's error carries the upstream's
--   message (error.message, message, detail), secrets in it redacted and cut to a bound, and the
--   ledger's attempt records it (`upstream_message`). custom_response leaves such an answer alone (the
--   metadata says it was written here); a refusal with no message to read gets custom_response's.
-- - The attempt filter's own refusal of an attempt (marked by its header) is the gateway's error, not an
--   upstream's: the metadata says so (`attempt_refused`) and custom_response leaves it alone too.

local find, sub, gsub, byte = string.find, string.sub, string.gsub, string.byte
local NS, K = CONFIG.namespace, CONFIG.keys

local SECRET = "[REDACTED]"

-- Secrets an upstream may echo back (a key it was sent, a token in a field it rejects), as the
-- gateway's own redaction finds them (extproc/redact.py's `bearer` and `cloud_key`), with the
-- lengths their patterns require; and any run of 40 or more key-like characters holding a digit, the
-- shape of a credential whose issuer the gateway does not know. Redacting too much costs a word of the
-- reason; too little, a credential.
local function longer(n)
  return function(m) if #m >= n then return SECRET end end
end
local function opaque(m)
  if #m >= 40 and find(m, "%d") and find(m, "%a") then return SECRET end
end
local function redacted(text)
  text = gsub(text, "([Bb]earer%s+)([%w%._~%+/%-]+=*)", function(word, token)
    if #token >= 16 then return word .. SECRET end
  end)
  text = gsub(text, "%f[%w]sk%-[%w_%-]+", longer(23))
  text = gsub(text, "%f[%w]A[KS]IA[%u%d]+", longer(20))
  text = gsub(text, "%f[%w]AIza[%w_%-]+", longer(39))
  text = gsub(text, "%f[%w]gh[pousr]_%w+", longer(40))
  return (gsub(text, "[%w_%-%+/=]+", opaque))
end

-- At most `limit` bytes of UTF-8 text, cut between characters, an ellipsis where it was cut.
local function capped(text, limit)
  if #text <= limit then return text end
  local at = limit
  while at > 0 do
    local next_byte = byte(text, at + 1)
    if next_byte < 0x80 or next_byte >= 0xC0 then break end  -- not in the middle of a character
    at = at - 1
  end
  return sub(text, 1, at) .. "\226\128\166"
end

-- The upstream's reason, as the shapes write it: error.message (OpenAI, Anthropic, Gemini), message
-- (Bedrock, vLLM), detail (a string, or a validation error's list of {msg}); a string `error` too.
local function reason_of(text)
  local doc = decode_all(text)
  if not is_object(doc) then return nil end
  local err, detail = doc.error, doc.detail
  local candidates = {
    is_object(err) and err.message or nil, type(err) == "string" and err or nil, doc.message, detail,
    is_array(detail) and is_object(detail[1]) and detail[1].msg or nil,
  }
  for i = 1, 5 do
    local v = candidates[i]
    if type(v) == "string" then
      local reason = gsub(gsub(gsub(unescape(v), "%s+", " "), "^ ", ""), " $", "")
      if reason ~= "" then return capped(redacted(reason), CONFIG.max_reason_bytes) end
    end
  end
  return nil
end

-- A refusal's reason into the contract's error, for a request the gateway admitted (it named the
-- cluster); nothing when the answer has no body, is larger than an error ever is, or names no reason.
-- (Handles taken before the body was read are out of scope after it: each is taken again.)
local function refused(h, md, status, length)
  local refusal = CONFIG.refusals[status]
  if refusal == nil or md == nil or md[K.cluster] == nil then return end
  if length ~= nil and length > CONFIG.max_refusal_bytes then return end
  local body = h:body()
  if body == nil or body:length() > CONFIG.max_refusal_bytes then return end
  local reason = reason_of(body:getBytes(0, body:length()))
  if reason == nil then return end
  h:streamInfo():dynamicMetadata():set(NS, K.upstream_message, reason)
  local headers = h:headers()
  headers:remove("content-length")
  headers:replace(":status", refusal.status)
  headers:replace("content-type", "application/json")
  headers:replace(CONFIG.should_retry_header, "false")  -- the upstream refused the request itself
  body:setBytes(refusal.before .. as_string(reason) .. refusal.after)
end

function envoy_on_response(h)
  local dm = h:streamInfo():dynamicMetadata()
  local md = dm:get(NS)
  if md ~= nil and md[K.upstream_status] ~= nil then return end
  local headers = h:headers()
  local status = headers:get(":status") or ""
  dm:set(NS, K.upstream_status, status)
  if headers:get(CONFIG.attempt_refused_header) ~= nil then
    headers:remove(CONFIG.attempt_refused_header)
    -- Believed only where the attempt filter runs (a plan): it removes the mark from every upstream's
    -- own answer, so there it is the filter's refusal, whose error is the contract's already (and no
    -- upstream's request id to read), which custom_response must leave as it is. Elsewhere it is an
    -- upstream's header, and its answer is judged as any other.
    if md ~= nil and md[K.plan] ~= nil then
      dm:set(NS, K.attempt_refused, "1")
      return
    end
  end
  -- the upstream's own request id, before Envoy puts its own x-request-id in the answer
  for _, name in ipairs(CONFIG.request_id_headers) do
    local v = headers:get(name)
    if v ~= nil and #v <= 128 and not find(v, "[^%w%-_.:]") then
      dm:set(NS, K.upstream_request_id, v)
      break
    end
  end
  refused(h, md, status, tonumber(headers:get("content-length") or ""))
end
