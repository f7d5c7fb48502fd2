-- A hosted OpenAI-shaped server's answers (its streams pass as they come) (the renderer puts this into extproc/lua/answers.lua, after its shared helpers).

-- A hosted OpenAI-shaped server's answer is already the internal shape: checked, passed as it came.
local function openai(body)
  local doc = decode_all(body)
  if not is_object(doc) or not is_array(doc.choices) then return nil end
  return body
end

ANSWERS.openai = openai
