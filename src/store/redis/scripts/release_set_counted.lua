-- Releases a set of locks, as release_set.lua does, where some (or all) of the keys have a
-- capacity (counted.lua): each key only if held with the token; with hand-off on, each key's
-- queue is served with what is freed, and the token leaves every key's queue.
-- KEYS, for each lock key of the set: the lock key, the fencing counter of its hash slot, and,
-- only with hand-off, its queue.
-- ARGV[1]: the token. ARGV[2]: '1' with hand-off, else '0'. ARGV[3]: the claim window in ms.
-- ARGV[4]: the fencing counter's retention in ms. Then for each key, in order: its weight and
-- its capacity ('0' and '0' for a plain key).
-- Returns how many of the keys were held with the token, live (and are released now).
local token, claim, retention = ARGV[1], ARGV[3], ARGV[4]
local handoff = ARGV[2] == '1'
local per = handoff and 3 or 2
local released = 0
for i = 1, #KEYS / per do
  local lock, fence_key = KEYS[per * (i - 1) + 1], KEYS[per * (i - 1) + 2]
  local queue = handoff and KEYS[per * i] or nil
  local weight, cap = ARGV[3 + 2 * i], ARGV[4 + 2 * i]
  if cap == '0' then
    if redis.call('GET', lock) == token then
      let_go(lock, fence_key, queue, claim, retention, token)
      released = released + 1
    elseif queue and redis.call('LLEN', queue) > 0 then
      leave(queue, token)
    end
  else
    released = released + counted_release(lock, fence_key, queue, token, weight, cap, claim,
      retention)
  end
end
return released
