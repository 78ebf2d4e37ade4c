-- Release a lock, only for its holder; with hand-off on, give it to the next waiter, and take a
-- waiter that gives up out of the queue.
-- KEYS[1]: the lock key. With hand-off: KEYS[2]: the fencing counter. KEYS[3]: its queue.
-- ARGV[1]: the holder's token. With hand-off: ARGV[2]: the claim window in ms. ARGV[3]: the
-- fencing counter's retention in ms.
-- Returns 1 when released, 0 when the lock is not held with this token.
local lock, fence_key, queue = KEYS[1], KEYS[2], KEYS[3]
local token = ARGV[1]
local held = redis.call('GET', lock) == token
if held and (not queue or redis.call('LLEN', queue) == 0) then
  -- The usual case: nobody waits.
  redis.call('DEL', lock)
  return 1
end
if not queue or (not held and redis.call('LLEN', queue) == 0) then
  return 0
end
-- @handoff
if held then
  let_go(lock, fence_key, queue, ARGV[2], ARGV[3], token)
  return 1
end
leave(queue, token)
return 0
