-- SSE framing for the gateway's Lua filters: where an event ends, and its data. The renderer puts this
-- after llmgw/lua/json.lua and before each script that reads a stream, so its locals are theirs.

local find, gmatch, concat = string.find, string.gmatch, table.concat
local CR_SEPARATORS = {"\r\n\r\n", "\r\r"}

-- An event's data: its `data:` lines joined (nil for an event without any). The common event is one
-- `data: ` line.
local function event_data(event)
  if sub(event, 1, 6) == "data: " then
    local nl = find(event, "\n", 7, true)
    if nl == #event - 1 and byte(event, nl - 1) ~= 13 then return sub(event, 7, nl - 1) end
  end
  local parts = nil
  for line in gmatch(event, "[^\r\n]+") do
    if sub(line, 1, 5) == "data:" then
      local d = sub(line, 6)
      if byte(d, 1) == 32 then d = sub(d, 2) end
      parts = parts or {}
      parts[#parts + 1] = d
    end
  end
  return parts and concat(parts, "\n")
end

-- The end of the first complete event in buf (its blank line included), or nil.
local function event_end(buf)
  local _, j = find(buf, "\n\n", 1, true)
  if find(buf, "\r", 1, true) == nil then return j end
  for _, sep in ipairs(CR_SEPARATORS) do
    local _, k = find(buf, sep, 1, true)
    if k and (j == nil or k < j) then j = k end
  end
  return j
end

-- A body rewritten chunk by chunk as it streams: `step(bytes, at_end)` gives each chunk's new text and
-- whether the stream has ended, after which every chunk is emptied. An HTTP/1 upstream's end arrives
-- as an empty last chunk, which may carry what `step` gives at the end.
local function rewrite_chunks(h, step)
  local ended = false
  for piece in h:bodyChunks() do
    local n = piece:length()
    if ended then
      if n > 0 then piece:setBytes("") end
    else
      local text
      text, ended = step(n > 0 and piece:getBytes(0, n) or "", n == 0)
      if n > 0 or text ~= "" then piece:setBytes(text) end
    end
    if n == 0 then break end
  end
end
