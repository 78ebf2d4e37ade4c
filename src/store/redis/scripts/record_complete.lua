-- Finishes an idempotent request: stores its record and releases its lock, in one step, only
-- for the lock's holder. No moment exists where the lock is gone and the record not yet written.
-- `lock`: the lock key. `record_key`: the record's key (same hash slot). With hand-off:
-- `fence_key`, `queue`, `claim`, `retention`, as for `release`. `token`: the holder's token.
-- `record`: the encoded record. `keep`: the record's retention in ms.
-- Returns 1 when stored and released, 0 (and changes nothing) when the lock is not ours.
local function complete(lock, record_key, fence_key, queue, token, record, keep, claim, retention)
  if redis.call('GET', lock) == token then
    redis.call('SET', record_key, record, 'PX', keep)
    let_go(lock, fence_key, queue, claim, retention, token)
    return 1
  end
  return 0
end

