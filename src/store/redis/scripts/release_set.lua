-- Release a set of locks, each only if held with the token; with hand-off on, give each to its
-- next waiter, and take the token out of every key's queue (a waiter that gives up).
-- KEYS, for each lock key of the set: without hand-off, the lock key; with hand-off, the lock
-- key, the fencing counter of its hash slot and its queue.
-- ARGV[1]: the token. With hand-off: ARGV[2]: the claim window in ms. ARGV[3]: the fencing
-- counter's retention in ms.
-- Returns how many of the keys were held with the token (and are released now).
local token = ARGV[1]
local released = 0
if ARGV[2] == nil then
  for _, lock in ipairs(KEYS) do
    if redis.call('GET', lock) == token then
      redis.call('DEL', lock)
      released = released + 1
    end
  end
  return released
end
-- @handoff
for i = 1, #KEYS / 3 do
  local lock, fence_key, queue = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if redis.call('GET', lock) == token then
    let_go(lock, fence_key, queue, ARGV[2], ARGV[3], token)
    released = released + 1
  elseif redis.call('LLEN', queue) > 0 then
    leave(queue, token)
  end
end
return released
