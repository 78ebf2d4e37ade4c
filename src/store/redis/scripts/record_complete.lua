-- Finishes an idempotent request: stores its record, and releases its lock if it still holds
-- it, in one step. No moment exists where the lock is gone and the record not yet written.
-- `lock`: the lock key. `record_key`: the record's key (same hash slot). With hand-off:
-- `fence_key`, `queue`, `claim`, `retention`, as for `release`. `token`: the holder's token.
-- `record`: the record as stored: 'F', the lease's fencing token in 20 digits, the encoded
-- record. `keep`: the record's retention in ms.
--
-- A record is fenced by its lease's token: it never replaces a record with a higher one. A
-- lease lost before its request finished still stores its record when nobody holds the key
-- (a retry then replays it instead of running the handler again), never while a newer holder
-- runs (its record is the one to keep).
-- Returns 1 when stored and released; 2 when stored, the lock not being ours any more (nor
-- anyone's); 3 when released but not stored (a newer record is there); 0 when neither (another
-- holder has the lock, or a newer record is there).
local function newer_record(record_key, record)
  local stored = redis.call('GET', record_key)
  -- Records written before records were fenced (no 'F') count as fenced by 0.
  return stored and string.sub(stored, 1, 1) == 'F'
    and string.sub(stored, 2, 21) > string.sub(record, 2, 21)
end

local function complete(lock, record_key, fence_key, queue, token, record, keep, claim, retention)
  local holder = redis.call('GET', lock)
  local newer = newer_record(record_key, record)
  if holder == token then
    if not newer then
      redis.call('SET', record_key, record, 'PX', keep)
    end
    let_go(lock, fence_key, queue, claim, retention, token)
    return newer and 3 or 1
  end
  if holder or newer then
    return 0
  end
  redis.call('SET', record_key, record, 'PX', keep)
  return 2
end
