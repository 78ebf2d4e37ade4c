-- Takes a set of locks at once, as acquire_set.lua does, where some (or all) of the keys have a
-- capacity (leases with counts, counted.lua; run only for such a set, so that the plain set
-- script stays as it is). A key with a capacity is the caller's when its member is there
-- (handed or kept for it), or its weight fits beside the live holders' and nobody queued before
-- it waits (its queue is served first: the head waits until its whole weight fits, and nobody
-- behind it is served before it). A plain key of the set is taken as acquire_set.lua takes it.
-- A set that will wait is queued for the first key it cannot have, in the key's one queue (a
-- counted key's entry carries its weight), and keeps the keys before it in lock order.
-- KEYS, for each lock key of the set, in lock order: the lock key, the fencing counter of its
-- hash slot, and, only with hand-off, its queue.
-- ARGV[1]: the caller's token. ARGV[2]: time to live in ms. ARGV[3]: counter retention in ms.
-- ARGV[4]: '1' with hand-off, else '0'. With hand-off: ARGV[5]: the claim window in ms;
-- ARGV[6]: the caller's stamp; ARGV[7]: the caller's channel, or '' to not queue; ARGV[8]: '1'
-- if the caller may be queued already. Then for each key, in lock order: its weight and its
-- capacity ('0' and '0' for a plain key).
-- Answers as acquire_set.lua. A key with a capacity that a plain lease holds, or a plain key
-- a lease with a share holds, is an error (`WRONGTYPE`): every user of a key takes it the same
-- way.
local token, ttl, retention = ARGV[1], ARGV[2], ARGV[3]
local handoff = ARGV[4] == '1'
local claim, channel = ARGV[5], ARGV[7]
local per = handoff and 3 or 2
local n = #KEYS / per
local function lock_of(i) return KEYS[per * (i - 1) + 1] end
local function fence_of(i) return KEYS[per * (i - 1) + 2] end
local function queue_of(i) return handoff and KEYS[per * i] or nil end
local function weight_of(i) return ARGV[7 + 2 * i] end
local function cap_of(i) return tonumber(ARGV[8 + 2 * i]) end
local function member_of(i) return token .. ':' .. weight_of(i) end

-- The weight key i's live holders take, the caller's included.
local function used_of(i)
  return counted_used(lock_of(i), counted_now(), cap_of(i), true)
end

-- Every key as its lease takes it, before anything is written: a key with a capacity holds
-- nothing or leases with a share, a plain key nothing or a plain lease.
for i = 1, n do
  local kind = redis.call('TYPE', lock_of(i)).ok
  if cap_of(i) ~= 0 and kind ~= 'none' and kind ~= 'zset' then
    counted_wrong(kind)
  elseif cap_of(i) == 0 and kind ~= 'none' and kind ~= 'string' then
    error({err = 'WRONGTYPE tower-lock: a lease with a share (permits, shared or exclusive) '
      .. 'holds this key, which this lease takes plain: every user of a key must take it the '
      .. 'same way'})
  end
end

-- Whether key i is the caller's already (handed or kept for it, or the same attempt sent
-- again).
local function mine(i)
  if cap_of(i) == 0 then
    return redis.call('GET', lock_of(i)) == token
  end
  used_of(i)
  return redis.call('ZSCORE', lock_of(i), member_of(i)) ~= false
end

-- When a waiter for key i should check again if told nothing (ms).
local function next_of(i)
  if cap_of(i) == 0 then
    return redis.call('PTTL', lock_of(i))
  end
  return counted_next(lock_of(i), counted_now())
end

-- Key i held for the caller for `ms`.
local function hold(i, ms)
  if cap_of(i) == 0 then
    redis.call('SET', lock_of(i), token, 'PX', ms)
  else
    counted_hold(lock_of(i), member_of(i), counted_now(), tonumber(ms), cap_of(i))
  end
end

-- Key i given back if the caller has it (to its next waiters, or freed); with `leaving`, the
-- caller's entries leave its queue too.
local function give_back(i, leaving)
  if cap_of(i) == 0 then
    if redis.call('GET', lock_of(i)) == token then
      let_go(lock_of(i), fence_of(i), queue_of(i), claim, retention, token)
    elseif leaving and queue_of(i) then
      leave(queue_of(i), token)
    end
  elseif leaving or redis.call('ZSCORE', lock_of(i), member_of(i)) then
    counted_release(lock_of(i), fence_of(i), queue_of(i), token, weight_of(i), cap_of(i), claim,
      retention)
  end
end

-- Every key for the caller, each with a fencing token of its own.
local function take_all()
  local out = {1}
  for i = 1, n do
    hold(i, ttl)
    out[i + 1] = new_fence(fence_of(i), retention)
  end
  return out
end

-- The usual case: every key the caller's or free for its weight, and nobody waits for any.
local blocked = nil
for i = 1, n do
  local queued = handoff and redis.call('LLEN', queue_of(i)) > 0
  if not mine(i) then
    local free
    if cap_of(i) == 0 then
      free = not redis.call('GET', lock_of(i))
    else
      free = used_of(i) + tonumber(weight_of(i)) <= cap_of(i)
    end
    if queued or not free then
      blocked = i
      break
    end
  end
end
if not blocked then
  if handoff then
    for i = 1, n do
      leave(queue_of(i), token)
    end
  end
  return take_all()
end
if not handoff then
  return {0, next_of(blocked), blocked}
end
-- @handoff
local toklen = #token

-- Whether the caller can have key i now. A free plain key is its when nobody waits for it, or
-- the caller comes first among the waiters still alive (as acquire_set.lua decides); a key with
-- a capacity serves its queue first, in order, and is the caller's when its own entry comes up
-- and fits, or when nobody waits any more and its weight fits.
local function can_have(i)
  local lock, queue = lock_of(i), queue_of(i)
  if cap_of(i) == 0 then
    local holder = redis.call('GET', lock)
    if holder then
      return holder == token
    end
    if redis.call('LLEN', queue) > 0 then
      redis.call('SET', lock, token, 'PX', ttl)
      return hand_over(lock, fence_of(i), queue, claim, retention, token, true) ~= 'handed'
    end
    return true
  end
  local used = used_of(i)
  if redis.call('ZSCORE', lock, member_of(i)) then
    return true
  end
  if redis.call('LLEN', queue) > 0 then
    local first
    used, first = counted_serve(lock, fence_of(i), queue, toklen, cap_of(i), used, counted_now(),
      claim, retention, token)
    if first then
      return true
    end
    if redis.call('LLEN', queue) > 0 then
      return false
    end
  end
  return used + tonumber(weight_of(i)) <= cap_of(i)
end

blocked = nil
for i = 1, n do
  if not can_have(i) then
    blocked = i
    break
  end
end
if not blocked then
  for i = 1, n do
    leave(queue_of(i), token)
  end
  return take_all()
end
local queue = queue_of(blocked)
if channel == '' or redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
  -- A caller that will not wait, or that nobody would tell of a hand-off here, keeps nothing.
  for i = 1, n do
    give_back(i, false)
  end
  return {channel == '' and 0 or 3, next_of(blocked), blocked}
end
-- Keeps the keys before the blocked one, for a TTL, and gives back any after it.
for i = 1, blocked - 1 do
  hold(i, ttl)
  leave(queue_of(i), token)
end
for i = blocked + 1, n do
  give_back(i, true)
end
local queued = false
if ARGV[8] == '1' then
  for _, e in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if string.sub(e, 1, toklen) == token then
      queued = true
      break
    end
  end
end
if not queued then
  local entry = token .. ARGV[6] .. channel
  if cap_of(blocked) ~= 0 then
    entry = token .. ARGV[6] .. string.format('%08x', tonumber(weight_of(blocked))) .. channel
  end
  redis.call('RPUSH', queue, entry)
end
local keep = 2 * math.max(tonumber(ttl), redis.call('PTTL', lock_of(blocked))) + tonumber(claim)
if redis.call('PTTL', queue) < keep then
  redis.call('PEXPIRE', queue, keep)
end
return {2, next_of(blocked), blocked}
