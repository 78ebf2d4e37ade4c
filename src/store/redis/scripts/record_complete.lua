-- Finish an idempotent request: store its record and release its lock, in one step, only for
-- the lock's holder. No moment exists where the lock is gone and the record not yet written.
-- (The lock scripts' shared functions, src/store/scripts/fence.lua and handoff.lua, come first.)
-- KEYS[1]: the lock key. KEYS[2]: the record key. With hand-off: KEYS[3]: the fencing counter.
-- KEYS[4]: the lock's queue (all in one hash slot).
-- ARGV[1]: the holder's token. ARGV[2]: the encoded record. ARGV[3]: retention in ms.
-- With hand-off: ARGV[4]: the claim window in ms. ARGV[5]: the fencing counter's retention.
-- Returns 1 when stored and released, 0 (and changes nothing) when the lock is not ours.
-- @handoff
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  let_go(KEYS[1], KEYS[3], KEYS[4], ARGV[4], ARGV[5], ARGV[1])
  return 1
end
return 0
