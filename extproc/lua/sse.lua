-- SSE framing for the gateway's Lua filters: where an event ends, and its data. The renderer puts this
-- after extproc/lua/json.lua and before each script that reads a stream, so its locals are theirs.

local find, gmatch, concat = string.find, string.gmatch, table.concat

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

-- Complete events out of a stream's chunks, in work linear in the bytes received: each byte is searched
-- once (a separator split between two chunks is found through the last 3 bytes kept before the new
-- ones; each separator's next place is searched for only once the events have passed it) and copied
-- once into its event. `split(chunk, events)` appends the chunk's complete events (each with its blank
-- line) to `events` and returns how many bytes of an event still arriving it holds.
local SEPARATORS = {"\n\n", "\r\n\r\n", "\r\r"}

local function event_splitter()
  local parts, held, tail = {}, 0, ""
  return function(chunk, events)
    local s = tail .. chunk
    local base, from = #tail, 1
    local starts, ends = {}, {}
    while true do
      local first, stop = nil, nil
      for i = 1, 3 do
        local a = starts[i]
        if a == nil or (a and a < from) then
          local b
          a, b = find(s, SEPARATORS[i], from, true)
          starts[i], ends[i] = a or false, b
        end
        if a and (first == nil or a < first) then first, stop = a, ends[i] end
      end
      if first == nil then break end
      if held > 0 then  -- the first event of the chunk ends what was held
        parts[#parts + 1] = sub(s, base + 1, stop)
        events[#events + 1] = concat(parts)
        parts, held = {}, 0
      else
        events[#events + 1] = sub(s, from, stop)
      end
      from = stop + 1
    end
    if from <= #s then
      local rest = sub(s, math.max(from, base + 1))
      if rest ~= "" then
        parts[#parts + 1] = rest
        held = held + #rest
      end
    end
    tail = held > 0 and sub(s, math.max(from, #s - 2)) or ""
    return held
  end
end

-- A body rewritten chunk by chunk as it streams: `step(bytes, at_end)` gives each chunk's new text and
-- whether the stream has ended, after which every chunk is emptied. The end arrives as an empty last
-- chunk (an HTTP/1 upstream's terminating chunk), or with the last bytes themselves (a whole answer
-- in one frame, or a filter before this one that wrote into the empty end): then the iterator simply
-- stops, and what `step` gives at the end joins the last chunk, which Envoy has not yet passed on.
local function rewrite_chunks(h, step)
  local ended, last, last_text = false, nil, ""
  for piece in h:bodyChunks() do
    local n = piece:length()
    if ended then
      if n > 0 then piece:setBytes("") end
    else
      local text
      text, ended = step(n > 0 and piece:getBytes(0, n) or "", n == 0)
      if n > 0 or text ~= "" then piece:setBytes(text) end
      last, last_text = piece, text
    end
    if n == 0 then return end
  end
  if not ended and last ~= nil then
    local text = step("", true)
    -- (a stream ended by trailers has passed its last chunk on already: nothing can be added then)
    if text ~= "" then pcall(last.setBytes, last, last_text .. text) end
  end
end
