-- Releases a lock, only for its holder; with hand-off on (`queue` given), gives it to the next
-- waiter, and takes a waiter that gives up out of the queue.
-- `lock`: the lock key. With hand-off: `fence_key`, the fencing counter; `queue`, its queue;
-- `claim`, the claim window in ms; `retention`, the counter's retention in ms. `token`: the
-- holder's token.
-- Returns 1 when released, 0 when the lock is not held with this token.
local function release(lock, fence_key, queue, token, claim, retention)
  local held = redis.call('GET', lock) == token
  if held and (not queue or redis.call('LLEN', queue) == 0) then
    -- The usual case: nobody waits.
    redis.call('DEL', lock)
    return 1
  end
  if not queue or (not held and redis.call('LLEN', queue) == 0) then
    return 0
  end
  if held then
    let_go(lock, fence_key, queue, claim, retention, token)
    return 1
  end
  leave(queue, token)
  return 0
end

