"""The store's Lua scripts. Every state change is one of these, so each is atomic in Valkey/Redis;
they are loaded once and called by SHA (extproc/store/pipe.py loads them again after a restart).
All keys of one call share the tenant's hash tag, so they also run on Redis Cluster."""

# Token buckets of a minute's size as GCRA theoretical arrival times (the gateway's quotas, providers'
# quotas): prepended to each script that charges or corrects one, so both kinds of bucket are one piece.
GCRA = """
-- The time a charge of `cost` units at `ms` per unit moves the bucket to; nil and how long until it has
-- room when that is more than a minute (the bucket's size) ahead of now.
local function gcra_charge(key, now, ms, cost)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + ms * cost
  if new_tat - now > 60000 then return nil, math.ceil(new_tat - now - 60000) end
  return new_tat
end

local function gcra_set(key, now, tat)
  redis.call('SET', key, tostring(tat), 'PX', math.ceil(tat - now) + 60000)
end

-- How many units at `ms` each a bucket has room for now.
local function gcra_room(key, now, ms)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  return (60000 - (tat - now)) / ms
end

-- Give back `ms` of a charge (what it did not use); an expired bucket has nothing left to correct.
local function gcra_return(key, ms)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat > 0 then redis.call('SET', key, tostring(tat - ms), 'KEEPTTL') end
end
"""

# KEYS: res, leases, inflight, idem, ledgered marker (APPEND_ONCE's), budgets..., rates..., the request's
#       not-processed mark (Store.mark_unprocessed)
# ARGV: rid, now_ms, lease_until_ms, micros, tokens, max_inflight, max_inflight_tokens, n_budgets, n_rates,
#       idem_body_hash, idem_ttl_ms, record_json, hint (the keys settlement touches: Reservation.hint),
#       then per budget: limit_micros, limit_tokens, expire_at_s; then per rate: ms_per_unit, cost
RESERVE = GCRA + """
local rid, now, lease_until = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local micros, tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_inflight, max_tokens = tonumber(ARGV[6]), tonumber(ARGV[7])
local nb, nr = tonumber(ARGV[8]), tonumber(ARGV[9])
local idem_hash = ARGV[10]

-- A request whose refusal was already recorded (its reserve's reply was lost, and the refusal released
-- what it might have held): this late copy of the reserve must not hold anything.
if redis.call('EXISTS', KEYS[5]) == 1 then return {'abandoned'} end
-- Envoy already answered it itself (its decision came too late): nothing may be held for it.
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return {'not_processed'} end

if idem_hash ~= '' then
  local st = redis.call('HMGET', KEYS[4], 'body', 'state', 'status', 'response', 'rid')
  if st[1] then
    if st[1] ~= idem_hash then return {'idempotency_key_reused'} end
    if st[2] == 'done' then return {'replay', st[3], st[4]} end
    if st[2] == 'ambiguous' then return {'idempotency_ambiguous', st[5] or ''} end
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
  local new_tat, wait = gcra_charge(KEYS[5 + nb + r], now, tonumber(ARGV[a]), tonumber(ARGV[a + 1]))
  a = a + 2
  if not new_tat then return {'rate_limited', tostring(wait), tostring(r)} end
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
  gcra_set(KEYS[5 + nb + r], now, new_tats[r])
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

# KEYS: res, leases, inflight, ledger, idem (a dummy key of the same tag when none), budgets..., tpm rates...,
#       and for a request admitted from a slice, the slice
# ARGV: rid, charge_micros (-1: the whole reservation), charge_tokens (-1: likewise), outcome_json, n_budgets,
#       n_tpm, idem_status ('' = forget the key; 'ambiguous' = keep it refusing retries, under the TTL it
#       was reserved with; else its answer's status: replay it), idem_response, idem_ttl_ms, then per tpm:
#       ms_per_token; then for a request admitted from a slice: the slice's id, the request's micros, tokens
# The ledger entry: the admission facts stored with the reservation, the outcome, and the amounts
# (a charge above the reservation is cut to it: invariant 3 holds whatever an upstream reports).
# Returns {1, reserved_micros, reserved_tokens, charged_micros, charged_tokens}, or {0} when already settled.
SETTLE = GCRA + """
local res = redis.call('HMGET', KEYS[1], 'micros', 'tokens', 'idem', 'record', 'att:1')
local nb, nt = tonumber(ARGV[5]), tonumber(ARGV[6])
if not res[1] then
  -- A request admitted from a worker's slice whose admission is not written yet (COMMIT_SLICE): its
  -- outcome waits in the slice, which settles it when the admission is written (or the slice ends).
  local sid = ARGV[10 + nt]
  if not sid or sid == '' or redis.call('EXISTS', KEYS[#KEYS]) == 0 then return {0} end
  if redis.call('HEXISTS', KEYS[#KEYS], 'c:' .. ARGV[1]) == 1 then return {0} end
  local sm, st = tonumber(ARGV[11 + nt]), tonumber(ARGV[12 + nt])
  local early = ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. sm .. ' ' .. st .. ' ' .. ARGV[4]
  if redis.call('HSETNX', KEYS[#KEYS], 'e:' .. ARGV[1], early) == 0 then return {0} end
  local em, et = tonumber(ARGV[2]), tonumber(ARGV[3])
  if em < 0 or em > sm then em = sm end
  if et < 0 or et > st then et = st end
  return {1, sm, st, em, et}
end
local rm, rt = tonumber(res[1]), tonumber(res[2])
local cm, ct = tonumber(ARGV[2]), tonumber(ARGV[3])
if cm < 0 or cm > rm then cm = rm end
if ct < 0 or ct > rt then ct = rt end
for b = 1, nb do
  local key = KEYS[5 + b]
  redis.call('HINCRBY', key, 'reserved_micros', -rm)
  redis.call('HINCRBY', key, 'reserved_tokens', -rt)
  redis.call('HINCRBY', key, 'settled_micros', cm)
  redis.call('HINCRBY', key, 'settled_tokens', ct)
end
for r = 1, nt do
  gcra_return(KEYS[5 + nb + r], (rt - ct) * tonumber(ARGV[9 + r]))
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
  if ARGV[7] == 'ambiguous' then
    redis.call('HSET', KEYS[5], 'state', 'ambiguous')
  elseif ARGV[7] ~= '' then
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

# KEYS: an Idempotency-Key's record. An operator's resolution of a key left `ambiguous` (its request may
# have run): forgotten, so a retry with it runs. Returns the state it found (nothing changed unless
# ambiguous): 'ambiguous' (now forgotten), 'inflight', 'done' or '' (no such key).
FORGET_AMBIGUOUS = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'ambiguous' then redis.call('DEL', KEYS[1]) end
return state or ''
"""

# KEYS: res, and for a request admitted from a slice, the slice. ARGV: attempt number, record_json, rid.
# An attempt of a reservation that is still open (a settled or unknown one gains nothing: no stray keys);
# settlement copies the attempts into the ledger. One whose admission is not written yet waits in the
# slice with it (COMMIT_SLICE moves it to the reservation, or into the ledger entry it settles).
ATTEMPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'att:' .. ARGV[1], ARGV[2])
  return 1
end
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 and redis.call('HEXISTS', KEYS[2], 'c:' .. ARGV[3]) == 0 then
  redis.call('HSET', KEYS[2], 'a' .. ARGV[1] .. ':' .. ARGV[3], ARGV[2])
  return 1
end
return 0
"""

# KEYS: the tenant's decision log stream
# ARGV: entries (each one decision log entry as JSON): one XADD per entry, in one call per flush, so the
#       worker packs one command instead of one per decision
DECISIONS = """
for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'entry', ARGV[i]) end
return #ARGV
"""

# Admission (extproc/admission.py). Every key of one pool shares the pool's hash tag.
# KEYS: slots (request id -> lease end, ms), waiting (request id -> its place), wait ends (request id ->
#       when it stops waiting, ms), tags (`v|<priority>|<tenant>`: the tenant's next start tag,
#       `c|<priority>`: the priority's clock, `s|<rid>`: a waiter's start tag)
# ARGV: rid, now_ms, lease_until_ms, limit, priority (0-100), tenant, weight, wait_until_ms (0: may not wait)
# A slot is an open lease: a gateway that crashed holding one frees it when the lease ends. One queue for
# every worker and replica: a waiter's place is its priority, then its start tag (start-time fair
# queuing): a tenant's next request starts 1/weight after its last, or at its priority's clock when it
# comes back after idling (no credit banked). With k slots free, the first k waiters are admitted, each
# when it (its worker) asks. A newcomer that may not wait is admitted only when a slot is free and nobody
# waits. Returns {1} admitted (again, for a retried call); {0, -1} refused without waiting;
# {0, 1, start} waiting, with its start tag.
ADMIT = """
local rid, now = ARGV[1], tonumber(ARGV[2])
local limit, prio = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, r in ipairs(gone) do
  redis.call('ZREM', KEYS[2], r)
  redis.call('HDEL', KEYS[4], 's|' .. r)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
if redis.call('ZSCORE', KEYS[1], rid) then return {1} end
local free = limit - redis.call('ZCARD', KEYS[1])
local start = redis.call('HGET', KEYS[4], 's|' .. rid)
if not start then
  if free > 0 and redis.call('ZCARD', KEYS[2]) == 0 then
    redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), rid)
    return {1}
  end
  local wait_until = tonumber(ARGV[8])
  if wait_until <= now then return {0, -1} end
  local vkey, ckey = 'v|' .. prio .. '|' .. ARGV[6], 'c|' .. prio
  local s = math.max(tonumber(redis.call('HGET', KEYS[4], vkey) or '0'),
                     tonumber(redis.call('HGET', KEYS[4], ckey) or '0'))
  redis.call('HSET', KEYS[4], vkey, tostring(s + 1 / tonumber(ARGV[7])), 's|' .. rid, tostring(s))
  redis.call('ZADD', KEYS[2], (100 - prio) * 4294967296 + s, rid)
  redis.call('ZADD', KEYS[3], wait_until, rid)
  redis.call('PEXPIRE', KEYS[4], 3600000)
  start = tostring(s)
end
if free > 0 then
  local rank = redis.call('ZRANK', KEYS[2], rid)
  if rank and rank < free then
    redis.call('ZREM', KEYS[2], rid)
    redis.call('ZREM', KEYS[3], rid)
    redis.call('HDEL', KEYS[4], 's|' .. rid)
    local ckey = 'c|' .. prio
    if tonumber(start) > tonumber(redis.call('HGET', KEYS[4], ckey) or '0') then
      redis.call('HSET', KEYS[4], ckey, start)
    end
    redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), rid)
    return {1}
  end
end
return {0, 1, start}
"""

# KEYS: waiting, wait ends, tags. ARGV: rid. A waiter that stops waiting (its wait ran out, its client
# went away) leaves the queue at once.
LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[3], 's|' .. ARGV[1])
"""

# KEYS: a pool's slots. ARGV: the slots (request ids, or a slice's members). Settlement (or a release)
# gives them back.
RELEASE_SLOT = """
return redis.call('ZREM', KEYS[1], unpack(ARGV))
"""

# KEYS: a pool's slots, its waiting requests. ARGV: slice id, now_ms, expires_ms, slots wanted, the pool's
# limit, share. A worker's slice of a pool's slots (extproc/admission.py PoolGate): k members
# `~<id>:<j>` ending at the slice's expiry, k at most 1/share of the slots free, and none while anyone
# waits (the queue's order is the store's). Returns k (0: no slice).
TAKE_SLOTS = """
local now, expires = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 then return 0 end
local free = tonumber(ARGV[5]) - redis.call('ZCARD', KEYS[1])
local k = math.min(tonumber(ARGV[4]), math.floor(free / tonumber(ARGV[6])))
if k < 2 then return 0 end
for j = 1, k do redis.call('ZADD', KEYS[1], expires, '~' .. ARGV[1] .. ':' .. j) end
return k
"""

# A deployment's provider quota and its tenants' shares: token buckets of a minute's size, refilled
# continuously (how providers count), charged as the gateway's own quotas are (GCRA). Every key of one
# deployment shares its hash tag. KEYS: the buckets. ARGV: now_ms, then per bucket: ms_per_unit, cost.
# Returns {'ok'} with every bucket charged, or {'limited', wait_ms, bucket} with none.
QUOTA = GCRA + """
local now = tonumber(ARGV[1])
local tats = {}
for i = 1, #KEYS do
  local tat, wait = gcra_charge(KEYS[i], now, tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1]))
  if not tat then return {'limited', tostring(wait), tostring(i)} end
  tats[i] = tat
end
for i = 1, #KEYS do gcra_set(KEYS[i], now, tats[i]) end
return {'ok'}
"""

# A worker's slice of a provider quota (extproc/provider_quota.py): k requests' worth charged at once, k
# no more than wanted and no more than 1/share of the room any bucket has, so a slice never takes a
# bucket's last room (near the quota, requests are charged one by one, by QUOTA). KEYS: the buckets.
# ARGV: now_ms, requests wanted, share, then per bucket: ms_per_unit, units of one request (1 for
# requests, its token bound for tokens). Returns k, or 0 (too little room: nothing charged).
TAKE_QUOTA = GCRA + """
local now, k, share = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, #KEYS do
  local each = tonumber(ARGV[3 + 2 * i])
  if each > 0 then k = math.min(k, math.floor(gcra_room(KEYS[i], now, tonumber(ARGV[2 + 2 * i])) / each / share)) end
end
if k < 2 then return 0 end
for i = 1, #KEYS do
  gcra_set(KEYS[i], now, gcra_charge(KEYS[i], now, tonumber(ARGV[2 + 2 * i]), k * tonumber(ARGV[3 + 2 * i])))
end
return k
"""

# KEYS: buckets. ARGV: per bucket, the milliseconds to give back (what a request held of it and did not
# use: the token bound less the tokens charged, or all of it for a request never dispatched).
QUOTA_RETURN = GCRA + """
for i = 1, #KEYS do gcra_return(KEYS[i], tonumber(ARGV[i])) end
return 1
"""

# Slices (extproc/slices.py): a worker holds a slice of a tenant's budgets, quotas and bulkhead, admits
# requests against it without the store, and writes their admissions behind, in batches.
# KEYS: slice, leases, inflight, budgets..., rates...
# ARGV: slice id, now_ms, expires_ms, requests wanted, one request's micros, its tokens, max_inflight,
#       max_inflight_tokens, n_budgets, n_rates, share, then per budget: limit_micros, limit_tokens,
#       expire_at_s; then per rate: ms_per_unit, units of one request (1 for requests, its tokens for
#       tokens); last, the keys it holds of as JSON (the sweeper ends a dead worker's slice with them)
# The slice holds k requests' worth: k no more than wanted and no more than 1/share of what every limit
# has left, so slices never take a limit's last room (near a limit, requests reserve one by one). Its
# requests are the tenant's open leases (members `~<id>:<j>` of the leases set, ending when the slice
# does), so the bulkhead counts them as in flight. Returns {k} (taken), or {0} (too little room: nothing
# taken).
TAKE_SLICE = GCRA + """
local id, now, expires = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local xm, xt = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_inflight, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
local nb, nr, share = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local k = tonumber(ARGV[4])
local function fit(room, each)
  if each > 0 then k = math.min(k, math.floor(room / each / share)) end
end
if max_inflight >= 0 then fit(max_inflight - redis.call('ZCARD', KEYS[2]), 1) end
if max_tokens >= 0 then fit(max_tokens - tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0'), xt) end
for b = 1, nb do
  local a = 12 + 3 * (b - 1)
  local lim_m, lim_t = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local h = redis.call('HMGET', KEYS[3 + b], 'reserved_micros', 'settled_micros', 'reserved_tokens', 'settled_tokens')
  if lim_m >= 0 then fit(lim_m - tonumber(h[1] or '0') - tonumber(h[2] or '0'), xm) end
  if lim_t >= 0 then fit(lim_t - tonumber(h[3] or '0') - tonumber(h[4] or '0'), xt) end
end
local a = 12 + 3 * nb
for r = 1, nr do
  fit(gcra_room(KEYS[3 + nb + r], now, tonumber(ARGV[a + 2 * (r - 1)])), tonumber(ARGV[a + 2 * (r - 1) + 1]))
end
if k < 2 then return {0} end
for b = 1, nb do
  local key = KEYS[3 + b]
  local fresh = redis.call('HINCRBY', key, 'reserved_micros', k * xm) == k * xm
  redis.call('HINCRBY', key, 'reserved_tokens', k * xt)
  local expire_at = tonumber(ARGV[14 + 3 * (b - 1)])
  if expire_at > 0 and fresh then redis.call('EXPIREAT', key, expire_at) end
end
for r = 1, nr do
  local ms, each = tonumber(ARGV[a + 2 * (r - 1)]), tonumber(ARGV[a + 2 * (r - 1) + 1])
  local tat = gcra_charge(KEYS[3 + nb + r], now, ms, k * each)
  gcra_set(KEYS[3 + nb + r], now, tat)
end
redis.call('HINCRBY', KEYS[3], 'tokens', k * xt)
for j = 1, k do redis.call('ZADD', KEYS[2], expires, '~' .. id .. ':' .. j) end
redis.call('HSET', KEYS[1], 'm', k * xm, 't', k * xt, 'n', k, 'k', k, 'expires', expires, 'keys', ARGV[#ARGV])
redis.call('PEXPIREAT', KEYS[1], expires + 86400000)
return {k}
"""

# KEYS: slice, leases, inflight, ledger, budgets..., rates..., then per admission: its res, its
#       not-processed mark, its ledgered-refusal mark
# ARGV: slice id, final (1: the slice ends: what it still holds goes back), n_budgets, n_rates, the outcome
#       of a request Envoy answered itself (released), the ledger facts of a request whose admission was
#       lost with its worker, then per rate: ms_per_unit, per_token (1/0); then per admission: rid,
#       member, micros, tokens, lease_until_ms, record_json, hint
# Each admission moves its amounts from the slice to a reservation of its own, as RESERVE would have
# made it - or, when its outcome came first (SETTLE left it in the slice), settles it at once; so does a
# request Envoy answered itself (released). Writing an admission twice changes nothing. A final call, or
# one after the slice's holder died (the sweeper's, with no admissions), settles outcomes still waiting
# (their admission facts lost with the worker) and gives back what the slice holds unused: its budgets'
# reservation, its quotas' units, its permits. A slice already gone (ended by the sweeper while its
# holder could not write) reserves each admission again, unchecked, rather than lose track of it.
# Returns {admissions written, settled}.
COMMIT_SLICE = GCRA + """
local id, final = ARGV[1], ARGV[2] == '1'
local nb, nr = tonumber(ARGV[3]), tonumber(ARGV[4])
local released, lost = ARGV[5], ARGV[6]
local rb, rr = 5, 5 + nb  -- KEYS: budgets from 5, rates from 5 + nb
local live = redis.call('EXISTS', KEYS[1]) == 1
local written, settled = 0, 0

-- The attempts recorded for a request while its admission was unwritten (ATTEMPT), taken out of the slice.
local function attempts_of(rid)
  local list = {}
  if not live then return list end
  local names = {}
  for n = 1, 6 do names[n] = 'a' .. n .. ':' .. rid end
  local atts = redis.call('HMGET', KEYS[1], unpack(names))
  for n = 1, 6 do
    if atts[n] then
      list[#list + 1] = {n, atts[n]}
      redis.call('HDEL', KEYS[1], names[n])
    end
  end
  return list
end

local function settle(rid, xm, xt, cm, ct, record, outcome)
  if cm < 0 or cm > xm then cm = xm end
  if ct < 0 or ct > xt then ct = xt end
  for b = 1, nb do
    redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_micros', -xm)
    redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_tokens', -xt)
    redis.call('HINCRBY', KEYS[rb + b - 1], 'settled_micros', cm)
    redis.call('HINCRBY', KEYS[rb + b - 1], 'settled_tokens', ct)
  end
  for r = 1, nr do
    if ARGV[6 + 2 * r] == '1' then gcra_return(KEYS[rr + r - 1], (xt - ct) * tonumber(ARGV[5 + 2 * r])) end
  end
  redis.call('HINCRBY', KEYS[3], 'tokens', -xt)
  local entry = {'record', record, 'outcome', outcome, 'reserved_micros', xm, 'reserved_tokens', xt,
                 'charged_micros', cm, 'charged_tokens', ct}
  local atts = attempts_of(rid)
  if #atts > 0 then
    local list = {}
    for _, a in ipairs(atts) do list[#list + 1] = a[2] end
    entry[#entry + 1] = 'attempts'
    entry[#entry + 1] = '[' .. table.concat(list, ',') .. ']'
  end
  redis.call('XADD', KEYS[4], '*', unpack(entry))
  settled = settled + 1
end

-- One admission: its amounts move from the slice to a reservation of its own (or it is settled at once).
local function write(rid, member, xm, xt, lease_until, record, hint, res, unprocessed, ledgered)
  if live and redis.call('HEXISTS', KEYS[1], 'c:' .. rid) == 1 then return end  -- written already
  if not live and redis.call('EXISTS', res) == 1 then return end
  if live then redis.call('HSET', KEYS[1], 'c:' .. rid, '1') end
  -- Refused after its write's reply was lost, and ledgered as refused: it holds nothing (the slice gives
  -- its amounts back when it ends) and no later outcome may settle it.
  if redis.call('EXISTS', ledgered) == 1 then return end
  redis.call('ZREM', KEYS[2], member)
  if live then
    redis.call('HINCRBY', KEYS[1], 'm', -xm)
    redis.call('HINCRBY', KEYS[1], 't', -xt)
    redis.call('HINCRBY', KEYS[1], 'n', -1)
  else  -- the slice ended without it: reserved again, unchecked, rather than lost track of
    for b = 1, nb do
      redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_micros', xm)
      redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_tokens', xt)
    end
    redis.call('HINCRBY', KEYS[3], 'tokens', xt)
  end
  local early = live and redis.call('HGET', KEYS[1], 'e:' .. rid)
  if early then
    redis.call('HDEL', KEYS[1], 'e:' .. rid)
    local cm, ct, _, _, outcome = string.match(early, '^(%S+) (%S+) (%S+) (%S+) (.*)$')
    settle(rid, xm, xt, tonumber(cm), tonumber(ct), record, outcome)
  elseif redis.call('EXISTS', unprocessed) == 1 then
    settle(rid, xm, xt, 0, 0, record, released)
  else
    redis.call('ZADD', KEYS[2], lease_until, rid)
    redis.call('HSET', res, 'micros', xm, 'tokens', xt, 'lease_until', lease_until, 'record', record,
               'hint', hint, 'idem', '')
    for _, att in ipairs(attempts_of(rid)) do redis.call('HSET', res, 'att:' .. att[1], att[2]) end
    written = written + 1
  end
end

local a, k = 7 + 2 * nr, rr + nr
while a <= #ARGV do
  write(ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5],
        ARGV[a + 6], KEYS[k], KEYS[k + 1], KEYS[k + 2])
  a, k = a + 7, k + 3
end

if final and live then
  local h = redis.call('HGETALL', KEYS[1])
  for f = 1, #h, 2 do
    local rid = string.match(h[f], '^e:(.*)$')
    if rid then
      -- an outcome whose admission never came: its worker died holding it (amounts in the outcome's hint)
      local cm, ct, xm, xt, outcome = string.match(h[f + 1], '^(%S+) (%S+) (%S+) (%S+) (.*)$')
      redis.call('HINCRBY', KEYS[1], 'm', -tonumber(xm))
      redis.call('HINCRBY', KEYS[1], 't', -tonumber(xt))
      redis.call('HINCRBY', KEYS[1], 'n', -1)
      local facts = cjson.decode(lost)
      facts['request_id'] = rid
      settle(rid, tonumber(xm), tonumber(xt), tonumber(cm), tonumber(ct), cjson.encode(facts), outcome)
    end
  end
  local m, t = tonumber(redis.call('HGET', KEYS[1], 'm')), tonumber(redis.call('HGET', KEYS[1], 't'))
  local n, k = tonumber(redis.call('HGET', KEYS[1], 'n')), tonumber(redis.call('HGET', KEYS[1], 'k'))
  for b = 1, nb do
    redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_micros', -m)
    redis.call('HINCRBY', KEYS[rb + b - 1], 'reserved_tokens', -t)
  end
  for r = 1, nr do
    local ms = tonumber(ARGV[5 + 2 * r])
    gcra_return(KEYS[rr + r - 1], (ARGV[6 + 2 * r] == '1' and t or n) * ms)
  end
  redis.call('HINCRBY', KEYS[3], 'tokens', -t)
  for j = 1, k do redis.call('ZREM', KEYS[2], '~' .. id .. ':' .. j) end
  redis.call('DEL', KEYS[1])
end
return {written, settled}
"""
