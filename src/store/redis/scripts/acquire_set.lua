-- Take a set of locks at once, all of them or none, with a fencing token for each; with hand-off
-- on, respect each key's queue, and let a caller that will wait keep its place.
-- KEYS, for each lock key of the set, in lock order: the lock key, the fencing counter of its
-- hash slot, and, only with hand-off, its queue.
-- ARGV[1]: the caller's token. ARGV[2]: time to live in ms. ARGV[3]: counter retention in ms.
-- With hand-off: ARGV[4]: the claim window in ms. ARGV[5]: the caller's stamp. ARGV[6]: the
-- caller's channel, or '' to not queue. ARGV[7]: '1' if the caller may be queued already.
-- Returns {1, fence of key 1, ..., fence of key n} when acquired (a key held with the caller's
-- own token counts as free: handed to it, kept for it, or the same acquire sent again);
-- {0, remaining ttl in ms, i} when key i is held by someone else, and the caller holds none of
-- them; {2, ms, i} when key i is held and the caller is queued for it, keeping the keys before
-- it (in lock order) for its next attempt; {3, ms, i} when key i is held and the caller not
-- queued, because nobody is subscribed to its channel on this server.
local token, ttl, retention = ARGV[1], ARGV[2], ARGV[3]
local handoff = ARGV[4] ~= nil
local per = handoff and 3 or 2
local n = #KEYS / per
local function lock_of(i) return KEYS[per * (i - 1) + 1] end
local function fence_of(i) return KEYS[per * (i - 1) + 2] end
local function queue_of(i) return KEYS[per * i] end

-- Every key for the caller, each with a fencing token of its own.
local function take_all()
  local out = {1}
  for i = 1, n do
    redis.call('SET', lock_of(i), token, 'PX', ttl)
    out[i + 1] = new_fence(fence_of(i), retention)
  end
  return out
end

-- The usual case: every key free (or the caller's own), and nobody waits for any of them.
local blocked = nil
for i = 1, n do
  local holder = redis.call('GET', lock_of(i))
  if (holder and holder ~= token) or (handoff and redis.call('LLEN', queue_of(i)) > 0) then
    blocked = i
    break
  end
end
if not blocked then
  return take_all()
end
if not handoff then
  return {0, redis.call('PTTL', lock_of(blocked)), blocked}
end
-- @handoff
local claim, channel = ARGV[4], ARGV[6]
local toklen = #token
-- Key by key, in lock order, up to the first the caller cannot have now. A key held with its
-- token is its. A free key is its when nobody waits for it, or the caller comes first among
-- the waiters still alive; otherwise the first live waiter gets it, as acquire.lua decides for
-- one key (the caller's SET stands, or is overwritten by the hand-over).
blocked = nil
for i = 1, n do
  local lock, queue = lock_of(i), queue_of(i)
  local holder = redis.call('GET', lock)
  if holder and holder ~= token then
    blocked = i
    break
  end
  if not holder and redis.call('LLEN', queue) > 0 then
    redis.call('SET', lock, token, 'PX', ttl)
    if hand_over(lock, fence_of(i), queue, claim, retention, token, true) == 'handed' then
      blocked = i
      break
    end
  end
end
if not blocked then
  for i = 1, n do
    leave(queue_of(i), token)
  end
  return take_all()
end
local lock, queue = lock_of(blocked), queue_of(blocked)
if channel == '' or redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
  -- A caller that will not wait, or that nobody would tell of a hand-off here, keeps nothing:
  -- what was handed or kept for it, or taken by this attempt, goes to the next waiter, or is
  -- freed.
  for i = 1, n do
    if redis.call('GET', lock_of(i)) == token then
      let_go(lock_of(i), fence_of(i), queue_of(i), claim, retention, token)
    end
  end
  return {channel == '' and 0 or 3, redis.call('PTTL', lock), blocked}
end
-- The caller waits for the blocked key. It keeps the keys before it, for a TTL (its attempts
-- keep them while it waits), and gives back any after it, which were handed or kept for it
-- while it waited for an earlier one: it never keeps a key while it waits for one before it in
-- lock order, so no set waits for another in a cycle.
for i = 1, blocked - 1 do
  redis.call('SET', lock_of(i), token, 'PX', ttl)
  leave(queue_of(i), token)
end
for i = blocked + 1, n do
  if redis.call('GET', lock_of(i)) == token then
    let_go(lock_of(i), fence_of(i), queue_of(i), claim, retention, token)
  else
    leave(queue_of(i), token)
  end
end
-- Queued for the blocked key as acquire.lua queues a waiter: it keeps its place if it has one.
local queued = false
if ARGV[7] == '1' then
  for _, e in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if string.sub(e, 1, toklen) == token then
      queued = true
      break
    end
  end
end
if not queued then
  redis.call('RPUSH', queue, token .. ARGV[5] .. channel)
end
local keep = 2 * math.max(tonumber(ttl), redis.call('PTTL', lock)) + tonumber(claim)
if redis.call('PTTL', queue) < keep then
  redis.call('PEXPIRE', queue, keep)
end
return {2, redis.call('PTTL', lock), blocked}
