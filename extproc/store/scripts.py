"""The store's Lua scripts. Every state change is one of these, so each is atomic in Valkey/Redis;
they are loaded once and called by SHA (extproc/store/pipe.py loads them again after a restart).
All keys of one call share the tenant's hash tag, so they also run on Redis Cluster."""

# KEYS: res, leases, inflight, idem, ledgered marker (APPEND_ONCE's), budgets..., rates...
# ARGV: rid, now_ms, lease_until_ms, micros, tokens, max_inflight, max_inflight_tokens, n_budgets, n_rates,
#       idem_body_hash, idem_ttl_ms, record_json, hint (the keys settlement touches: Reservation.hint),
#       then per budget: limit_micros, limit_tokens, expire_at_s; then per rate: ms_per_unit, cost
RESERVE = """
local rid, now, lease_until = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local micros, tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_inflight, max_tokens = tonumber(ARGV[6]), tonumber(ARGV[7])
local nb, nr = tonumber(ARGV[8]), tonumber(ARGV[9])
local idem_hash = ARGV[10]

-- A request whose refusal was already recorded (its reserve's reply was lost, and the refusal released
-- what it might have held): this late copy of the reserve must not hold anything.
if redis.call('EXISTS', KEYS[5]) == 1 then return {'abandoned'} end

if idem_hash ~= '' then
  local st = redis.call('HMGET', KEYS[4], 'body', 'state', 'status', 'response')
  if st[1] then
    if st[1] ~= idem_hash then return {'idempotency_key_reused'} end
    if st[2] == 'done' then return {'replay', st[3], st[4]} end
    return {'idempotency_conflict'}
  end
end

-- In-flight requests are the open leases; in-flight tokens are counted beside them.
local nreq = redis.call('ZCARD', KEYS[2])
local ntok = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0')
if max_inflight >= 0 and nreq + 1 > max_inflight then return {'concurrency_limited', 'requests'} end
if max_tokens >= 0 and ntok + tokens > max_tokens then return {'concurrency_limited', 'tokens'} end

local a = 14 + 3 * nb
local new_tats = {}
for r = 1, nr do
  local ms_per_unit, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  local tat = tonumber(redis.call('GET', KEYS[5 + nb + r]) or '0')
  if tat < now then tat = now end
  local new_tat = tat + ms_per_unit * cost
  if new_tat - now > 60000 then
    return {'rate_limited', tostring(math.ceil(new_tat - now - 60000)), tostring(r)}
  end
  new_tats[r] = new_tat
end

for b = 1, nb do
  local lim_m, lim_t = tonumber(ARGV[14 + 3 * (b - 1)]), tonumber(ARGV[15 + 3 * (b - 1)])
  local h = redis.call('HMGET', KEYS[5 + b], 'reserved_micros', 'settled_micros', 'reserved_tokens', 'settled_tokens')
  local used_m = tonumber(h[1] or '0') + tonumber(h[2] or '0')
  local used_t = tonumber(h[3] or '0') + tonumber(h[4] or '0')
  if (lim_m >= 0 and used_m + micros > lim_m) or (lim_t >= 0 and used_t + tokens > lim_t) then
    return {'budget_exhausted', tostring(b)}
  end
end

for b = 1, nb do
  local key = KEYS[5 + b]
  local fresh = redis.call('HINCRBY', key, 'reserved_micros', micros) == micros
  redis.call('HINCRBY', key, 'reserved_tokens', tokens)
  local expire_at = tonumber(ARGV[16 + 3 * (b - 1)])
  -- A window's key expires with its window: set when the key starts (or nothing else is reserved).
  if expire_at > 0 and fresh then redis.call('EXPIREAT', key, expire_at) end
end
for r = 1, nr do
  redis.call('SET', KEYS[5 + nb + r], tostring(new_tats[r]), 'PX', math.ceil(new_tats[r] - now) + 60000)
end
redis.call('HINCRBY', KEYS[3], 'tokens', tokens)
redis.call('ZADD', KEYS[2], lease_until, rid)
redis.call('HSET', KEYS[1], 'micros', micros, 'tokens', tokens, 'lease_until', lease_until,
           'record', ARGV[12], 'hint', ARGV[13], 'idem', idem_hash ~= '' and KEYS[4] or '')
if idem_hash ~= '' then
  redis.call('HSET', KEYS[4], 'body', idem_hash, 'state', 'inflight', 'rid', rid)
  redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[11]))
end
return {'ok'}
"""

# KEYS: res, leases, inflight, ledger, idem (a dummy key of the same tag when none), budgets..., tpm rates...
# ARGV: rid, charge_micros (-1: the whole reservation), charge_tokens (-1: likewise), outcome_json, n_budgets,
#       n_tpm, idem_status ('' = forget the key), idem_response, idem_ttl_ms, then per tpm: ms_per_token
# The ledger entry: the admission facts stored with the reservation, the outcome, and the amounts
# (a charge above the reservation is cut to it: invariant 3 holds whatever an upstream reports).
# Returns {1, reserved_micros, reserved_tokens, charged_micros, charged_tokens}, or {0} when already settled.
SETTLE = """
local res = redis.call('HMGET', KEYS[1], 'micros', 'tokens', 'idem', 'record', 'att:1')
if not res[1] then return {0} end
local rm, rt = tonumber(res[1]), tonumber(res[2])
local cm, ct = tonumber(ARGV[2]), tonumber(ARGV[3])
if cm < 0 or cm > rm then cm = rm end
if ct < 0 or ct > rt then ct = rt end
local nb, nt = tonumber(ARGV[5]), tonumber(ARGV[6])
for b = 1, nb do
  local key = KEYS[5 + b]
  redis.call('HINCRBY', key, 'reserved_micros', -rm)
  redis.call('HINCRBY', key, 'reserved_tokens', -rt)
  redis.call('HINCRBY', key, 'settled_micros', cm)
  redis.call('HINCRBY', key, 'settled_tokens', ct)
end
for r = 1, nt do
  local key = KEYS[5 + nb + r]
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat > 0 then  -- an expired key has nothing left to correct
    redis.call('SET', key, tostring(tat - (rt - ct) * tonumber(ARGV[9 + r])), 'KEEPTTL')
  end
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'tokens', -rt)
local entry = {'record', res[4] or '{}', 'outcome', ARGV[4],
               'reserved_micros', rm, 'reserved_tokens', rt, 'charged_micros', cm, 'charged_tokens', ct}
if res[5] then  -- attempts the attempt filter recorded (fallback routes): every one of them, in order
  local atts = redis.call('HMGET', KEYS[1], 'att:1', 'att:2', 'att:3', 'att:4', 'att:5', 'att:6')
  local list = {}
  for i = 1, #atts do if atts[i] then list[#list + 1] = atts[i] end end
  entry[#entry + 1] = 'attempts'
  entry[#entry + 1] = '[' .. table.concat(list, ',') .. ']'
end
redis.call('XADD', KEYS[4], '*', unpack(entry))
if res[3] and res[3] ~= '' then
  if ARGV[7] ~= '' then
    redis.call('HSET', KEYS[5], 'state', 'done', 'status', ARGV[7], 'response', ARGV[8])
    redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[9]))
  else
    redis.call('DEL', KEYS[5])
  end
end
redis.call('DEL', KEYS[1])
return {1, rm, rt, cm, ct}
"""

# KEYS: the tenant's ledger stream, the request's ledgered marker ({tenant}:ledgered:{rid})
# ARGV: record_json, outcome_json, marker_ttl_s
# The ledger entry of a request that reserved nothing (denied, refused), appended once: the marker
# makes a retry after a lost reply (a store timeout) a no-op instead of a second entry.
APPEND_ONCE = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[3])) then return 0 end
redis.call('XADD', KEYS[1], '*', 'record', ARGV[1], 'outcome', ARGV[2],
           'reserved_micros', 0, 'reserved_tokens', 0, 'charged_micros', 0, 'charged_tokens', 0)
return 1
"""

# KEYS: res. ARGV: attempt number, record_json. An attempt of a reservation that is still open (a
# settled or unknown one gains nothing: no stray keys); settlement copies the attempts into the ledger.
ATTEMPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'att:' .. ARGV[1], ARGV[2])
return 1
"""

# KEYS: the tenant's decision log stream
# ARGV: entries (each one decision log entry as JSON): one XADD per entry, in one call per flush, so the
#       worker packs one command instead of one per decision
DECISIONS = """
for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'entry', ARGV[i]) end
return #ARGV
"""
