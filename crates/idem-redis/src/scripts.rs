//! The Lua scripts of the store. Each one touches the keys of one hash slot
//! only — a row and its fencing counter (same hash tag), or the expiry index
//! alone — so every script runs on Redis Cluster.
//!
//! Row fields: `fp` fingerprint, `st` status (0 in progress, 1 completed, 2
//! rejected, 3 unknown, 4 sent), `tok` fencing token (a decimal string),
//! `lease` lease expiry, `exp` key expiry (both ms on the engine's clock),
//! `tn`/`op`/`k` tenant, operation and key, `cr` creation time, `pl`
//! recorded outcome, `sent` the earliest time the claim was marked sent (ms
//! on the engine's clock; absent if never marked, as in every row written
//! before sent claims existed).
//!
//! A claim is held (its holder may complete, release, extend or mark it)
//! while its status is 0 or 4. A status-4 row is never stale before its key
//! expires: the claim's staleness test takes over an expired lease only at
//! status 0, and a sent row whose lease has run out is an unknown outcome.

/// Claims a key: KEYS = row, counter; ARGV = fingerprint, now, expiry,
/// fresh token, lease expiry, TTL in ms, tenant, operation, key.
pub(crate) const CLAIM: &str = r#"
local function gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function plus_one(s)
  local d = {}
  for i = 1, #s do d[i] = string.byte(s, i) - 48 end
  local i = #d
  while i >= 1 do
    if d[i] < 9 then d[i] = d[i] + 1; break end
    d[i] = 0
    i = i - 1
  end
  local out = {}
  if i == 0 then out[1] = '1' end
  for j = 1, #d do out[#out + 1] = string.char(d[j] + 48) end
  return table.concat(out)
end
local now = tonumber(ARGV[2])
local r = redis.call('HMGET', KEYS[1], 'fp', 'st', 'tok', 'lease', 'exp', 'pl')
if r[1] then
  -- Only an in-progress lease (status 0) past its end is stale before the
  -- key expires; a sent one (status 4) is held as an unknown outcome.
  local stale = tonumber(r[5]) <= now or (r[2] == '0' and tonumber(r[4]) <= now)
  if not stale then
    return {'found', r[1], r[2], r[3], r[4] or '', r[5], r[6] or ''}
  end
end
local token = ARGV[4]
local last = redis.call('GET', KEYS[2])
if last then
  local n = plus_one(last)
  if gt(n, token) then token = n end
end
if r[3] then
  local n = plus_one(r[3])
  if gt(n, token) then token = n end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'st', '0', 'tok', token, 'lease', ARGV[5], 'exp', ARGV[3],
  'tn', ARGV[7], 'op', ARGV[8], 'k', ARGV[9], 'cr', ARGV[2])
local ttl = tonumber(ARGV[6])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('SET', KEYS[2], token, 'PX', ttl + 604800000)
return {'acquired', token}
"#;

/// Records an outcome with the holder's token on a held claim (status 0 or
/// 4, lease run out or not): KEYS = row; ARGV = token, status, payload. The
/// sent mark's time stays. 1 done, 0 fenced.
pub(crate) const COMPLETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if (r[1] ~= '0' and r[1] ~= '4') or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3])
redis.call('HDEL', KEYS[1], 'lease')
return 1
"#;

/// Gives a held key (status 0 or 4) back with the holder's token: KEYS =
/// row; ARGV = token. 1 done, 0 fenced.
pub(crate) const RELEASE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if (r[1] ~= '0' and r[1] ~= '4') or r[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

/// Moves a held lease (status 0 or 4) to ARGV[2] with the holder's token
/// ARGV[1]: KEYS = row, counter. 0 fenced, 1 done, 2 done and the key's
/// expiry raised to the lease's end.
///
/// A lease never outlives its key: like the SQL stores' `expires_at_ms =
/// GREATEST(expires_at_ms, lease)`, the row's expiry moves up to the new
/// lease end. Redis keeps the row by its TTL on its own clock, and the
/// row's `exp` is on the engine's clock; both move by the same amount, so
/// the row lives as long past its expiry as before, and the fencing counter
/// outlives the row by at least a week as at the claim.
pub(crate) const EXTEND: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok', 'exp')
if (r[1] ~= '0' and r[1] ~= '4') or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease', ARGV[2])
local raise = tonumber(ARGV[2]) - tonumber(r[3])
if raise <= 0 then return 1 end
local pttl = redis.call('PTTL', KEYS[1])
if pttl > 0 then
  local ttl = pttl + raise
  redis.call('PEXPIRE', KEYS[1], ttl)
  local kept = redis.call('PTTL', KEYS[2])
  if kept >= 0 and kept < ttl + 604800000 then
    redis.call('PEXPIRE', KEYS[2], ttl + 604800000)
  end
end
redis.call('HSET', KEYS[1], 'exp', ARGV[2])
return 2
"#;

/// Resolves an unknown outcome: KEYS = row; ARGV = now, then 'r' and a
/// status and payload to record, or 'd' to delete the row. Only a row
/// whose expiry is after now and that holds an unknown outcome — status 3,
/// or status 4 (sent) with its lease run out — is changed; a recorded one
/// keeps its expiry and sent mark, and loses its lease. 1 done, 0 no such
/// unknown outcome.
pub(crate) const RESOLVE: &str = r#"
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', KEYS[1], 'st', 'exp', 'lease')
if not r[2] or tonumber(r[2]) <= now then return 0 end
local unknown = r[1] == '3' or (r[1] == '4' and r[3] and tonumber(r[3]) <= now)
if not unknown then return 0 end
if ARGV[2] == 'r' then
  redis.call('HSET', KEYS[1], 'st', ARGV[3], 'pl', ARGV[4])
  redis.call('HDEL', KEYS[1], 'lease')
else
  redis.call('DEL', KEYS[1])
end
return 1
"#;

/// Marks a held claim (status 0 or 4, lease run out or not) sent with the
/// holder's token: KEYS = row; ARGV = token, now. Sets status 4 and keeps
/// the earliest mark's time in `sent`. 1 done, 0 fenced.
pub(crate) const MARK_SENT: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok', 'sent')
if (r[1] ~= '0' and r[1] ~= '4') or r[2] ~= ARGV[1] then return 0 end
local at = ARGV[2]
if r[3] and tonumber(r[3]) < tonumber(at) then at = r[3] end
redis.call('HSET', KEYS[1], 'st', '4', 'sent', at)
return 1
"#;

/// Looks at the row an expiry-index entry points at, at ARGV[1] (now):
/// KEYS = row. `{0, ''}` the row is gone (Redis expired it by its TTL, or
/// it was released or purged): the entry is a ghost; `{1, exp}` the row had
/// expired and was deleted; `{2, exp}` the row lives, until `exp`.
pub(crate) const SWEEP_ONE: &str = r#"
local exp = redis.call('HGET', KEYS[1], 'exp')
if not exp then return {0, ''} end
if tonumber(exp) <= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return {1, exp}
end
return {2, exp}
"#;

/// Settles expiry-index entries after their rows were looked at: KEYS =
/// index; ARGV = triples (op, tag, score). `r` removes the entry if its
/// score is still at most `score` (a row claimed again since then has
/// indexed a later expiry, and keeps its entry); `m` moves the entry up to
/// `score` (a live row's expiry), never down. Answers how many it removed.
pub(crate) const SETTLE_INDEX: &str = r#"
local removed = 0
for i = 1, #ARGV, 3 do
  local op, tag, score = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local s = redis.call('ZSCORE', KEYS[1], tag)
  if op == 'r' then
    if s and tonumber(s) <= score then
      redis.call('ZREM', KEYS[1], tag)
      removed = removed + 1
    end
  elseif (not s) or tonumber(s) < score then
    redis.call('ZADD', KEYS[1], score, tag)
  end
end
return removed
"#;

/// Deletes a row only if it still matches the purge's filter: KEYS = row;
/// ARGV = now, then for tenant, operation and key prefix a flag ('1' set)
/// and a value, then the state's name ('' any), then a flag and the newest
/// creation time allowed (older-than). Answers the deleted row's expiry,
/// or nil. The state rules are `KeyState::of`'s, and the filter rules
/// `KeyFilter::matches`'s.
pub(crate) const PURGE_ONE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'tn', 'op', 'k', 'st', 'cr', 'exp')
if not r[1] or not r[6] then return false end
if ARGV[2] == '1' and r[1] ~= ARGV[3] then return false end
if ARGV[4] == '1' and r[2] ~= ARGV[5] then return false end
if ARGV[6] == '1' and string.sub(r[3], 1, #ARGV[7]) ~= ARGV[7] then return false end
if ARGV[8] ~= '' then
  local state
  if tonumber(r[6]) <= tonumber(ARGV[1]) then state = 'expired'
  elseif r[4] == '0' then state = 'in_progress'
  elseif r[4] == '2' then state = 'rejected'
  elseif r[4] == '3' then state = 'unknown'
  elseif r[4] == '4' then state = 'sent'
  else state = 'completed' end
  if state ~= ARGV[8] then return false end
end
if ARGV[9] == '1' and tonumber(r[5]) > tonumber(ARGV[10]) then return false end
redis.call('DEL', KEYS[1])
return r[6]
"#;
