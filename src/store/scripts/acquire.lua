-- Take a lock if it is free, and hand out a fencing token; with hand-off on, respect the queue.
-- KEYS[1]: the lock key. KEYS[2]: its fencing counter. KEYS[3], only with hand-off: its queue.
-- ARGV[1]: the caller's token. ARGV[2]: time to live in ms. ARGV[3]: counter retention in ms.
-- With hand-off: ARGV[4]: the claim window in ms. ARGV[5]: the caller's queue entry, or '' to
-- not queue (a caller that will not wait, or cannot hear the hand-off).
-- Returns {1, fencing token} when acquired (or a hand-off to the caller claimed),
-- {0, remaining ttl in ms} when held by someone else, {2, ms} when held and the caller is
-- queued (check again within that many ms if told nothing).
local lock, fence_key, queue = KEYS[1], KEYS[2], KEYS[3]
local token, ttl, retention = ARGV[1], ARGV[2], ARGV[3]
if not queue then
  if redis.call('SET', lock, token, 'NX', 'PX', ttl) then
    return {1, new_fence(fence_key, retention)}
  end
  return {0, redis.call('PTTL', lock)}
end
local claim, entry = ARGV[4], ARGV[5]
local holder = redis.call('GET', lock)
if holder == token then
  -- Handed to the caller by a release: claim it for the full time to live.
  redis.call('PEXPIRE', lock, ttl)
  return {1, tonumber(redis.call('GET', fence_key) or '0') or 0}
end
local pttl
if not holder then
  local head = redis.call('LINDEX', queue, 0)
  if not head or string.sub(head, 1, #token) == token then
    -- Free, and nobody waits before the caller.
    if head then
      leave(queue, token)
    end
    redis.call('SET', lock, token, 'PX', ttl)
    return {1, new_fence(fence_key, retention)}
  end
  -- Free, but others wait (a holder's lease ran out, or a hand-off went unclaimed): the key
  -- goes to the head of the queue, not to the caller.
  hand_over(lock, fence_key, queue, claim, retention, token)
  pttl = tonumber(claim)
else
  pttl = redis.call('PTTL', lock)
end
if entry == '' then
  return {0, pttl}
end
if not redis.call('LPOS', queue, entry) then
  redis.call('RPUSH', queue, entry)
end
-- The queue outlives its waiters' checks (each checks again within the holder's TTL).
redis.call('PEXPIRE', queue, 2 * tonumber(ttl) + tonumber(claim))
return {2, pttl}
