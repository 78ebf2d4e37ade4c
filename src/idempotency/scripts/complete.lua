-- Finish an idempotent request: store its record and release its lock, in one step, only for
-- the lock's holder. No moment exists where the lock is gone and the record not yet written.
-- KEYS[1]: the lock key. KEYS[2]: the record key. KEYS[3], only when releases are announced:
-- the lock's "someone waits" marker (all in one hash slot).
-- ARGV[1]: the holder's token. ARGV[2]: the encoded record. ARGV[3]: retention in ms.
-- ARGV[4]: the channel to announce the release on ('' for none).
-- Returns 1 when stored and released, 0 (and changes nothing) when the lock is not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  if KEYS[3] and redis.call('DEL', KEYS[3]) == 1 and ARGV[4] ~= '' then
    redis.call('PUBLISH', ARGV[4], KEYS[1])
  end
  return 1
end
return 0
