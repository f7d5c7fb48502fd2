"""Envoy's Lua stream handle as the gateway's Lua filters use it, for tests that run them under LuaJIT
(lupa's build): a body as chunks, each one's bytes replaceable."""

# body_chunks(chunks, outs): the iterator `bodyChunks()` returns; outs[i] gets what chunk i became (as
# it came, unless the script replaced it). An empty chunk is the end of an HTTP/1 upstream's stream.
BODY_CHUNKS = """
function body_chunks(chunks, outs)
  local i = 0
  return function()
    i = i + 1
    if chunks[i] == nil then return nil end
    local c = {s = chunks[i]}
    function c:length() return #self.s end
    function c:getBytes(at, n) return string.sub(self.s, at + 1, at + n) end
    function c:setBytes(s) outs[i] = s end
    outs[i] = c.s
    return c
  end
end
"""
