"""Envoy's Lua stream handle as the gateway's Lua filters use it, for tests that run them under LuaJIT
(lupa's build): a body as chunks, each one's bytes replaceable; a whole body; headers; metadata."""

from typing import Any

# The globals Envoy gives its Lua filters that the gateway's scripts use.
ENVOY_GLOBALS = """
EnvoyTimestampResolution = {MILLISECOND = 0, MICROSECOND = 1}
"""

# body_chunks(chunks, outs): the iterator `bodyChunks()` returns; outs[i] gets what chunk i became (as
# it came, unless the script replaced it). An empty chunk is the end of an HTTP/1 upstream's stream.
BODY_CHUNKS = """
function body_chunks(chunks, outs)
  local i = 0
  return function()
    i = i + 1
    if chunks[i] == nil then return nil end
    local c = {s = chunks[i], at = i}
    function c:length() return #self.s end
    function c:getBytes(at, n) return string.sub(self.s, at + 1, at + n) end
    function c:setBytes(s) outs[self.at] = s end  -- (the last chunk stays writable after the loop, as in Envoy)
    outs[i] = c.s
    return c
  end
end
"""

# Envoy's handle as the script uses it: metadata get/set in one namespace, the headers, and the whole
# body (which may be replaced). Headers taken before body() are out of scope after it, as in Envoy.
HARNESS = ENVOY_GLOBALS + BODY_CHUNKS + """
local function handle(md, hdrs, body)
  local sets, out, epoch = {}, {body = body}, 0
  local dm = {get = function(self, ns) return md end,
              set = function(self, ns, k, v) sets[k] = v; md[k] = v end}
  local si = {dynamicMetadata = function(self) return dm end}
  local buf = body and {length = function(self) return #body end,
                        getBytes = function(self, at, n) return string.sub(body, at + 1, at + n) end,
                        setBytes = function(self, s) out.body = s end}
  local h = {
    streamInfo = function(self) return si end,
    headers = function(self)
      local mine = epoch
      local function live() if mine ~= epoch then error("object used outside of proper scope") end end
      return {get = function(self, k) live(); return hdrs[k] end,
              replace = function(self, k, v) live(); hdrs[k] = v end,
              remove = function(self, k) live(); hdrs[k] = nil end}
    end,
    body = function(self) epoch = epoch + 1; return buf end,
    timestampString = function(self, resolution) return "0" end,
  }
  return h, sets, out
end

function run_response(md, hdrs, body)
  local h, sets, out = handle(md, hdrs, body)
  envoy_on_response(h)
  return out.body, hdrs, sets
end

function run_stream(md, hdrs, chunks)
  local h, sets = handle(md, hdrs, nil)
  local outs = {}
  h.bodyChunks = function(self) return body_chunks(chunks, outs) end
  envoy_on_response(h)
  return outs, hdrs
end

function run_request(md, hdrs)
  local h, sets = handle(md, hdrs, nil)
  envoy_on_request(h)
  return hdrs, sets
end
"""


def lua_runtime(script: str) -> Any:
    """LuaJIT (lupa's) running a rendered filter script with the handle above."""
    from lupa import luajit21
    runtime = luajit21.LuaRuntime(unpack_returned_tuples=True, encoding=None)
    runtime.execute(script)
    runtime.execute(HARNESS)
    return runtime


def lua_table(lua: Any, d: dict[str, Any]) -> Any:
    """A Lua table of byte strings (nested dicts as tables), as Envoy hands metadata and headers."""
    return lua.table_from({k.encode(): (lua_table(lua, v) if isinstance(v, dict) else v.encode())
                           for k, v in d.items()})
