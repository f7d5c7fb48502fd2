-- A hosted OpenAI-shaped server's answers (its streams pass as they come) (the renderer puts this into extproc/lua/answers.lua, after its shared helpers).

-- A hosted OpenAI-shaped server's answer (and a pool engine's JSON answer: the decision names this shape
-- for it) is already the internal shape: checked to be a chat completion, passed as it came.
local function openai(body)
  local doc = decode_all(body)
  if not is_object(doc) or not is_array(doc.choices) then return nil end
  local first = doc.choices[1]
  if is_object(first) and type(first.finish_reason) == "string" and #first.finish_reason <= 64 then
    NATIVE.normal = first.finish_reason  -- already the internal name
  end
  return body
end

ANSWERS.openai = openai
