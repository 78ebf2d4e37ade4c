-- Keys with a capacity (leases with counts: permits, shared and exclusive leases). Defined only
-- in the `counted` script, so that the plain lock's script defines none of this.
--
-- Such a lock key is a sorted set of its holders: each member is a holder's token, ':' and its
-- weight; its score, when that holder's lease ends (server time, ms). Beside it, its sum key
-- (`<prefix>{<tag>}weight:<rest of the lock key>`, same slot; `counted_sum_key`), a hash, holds
-- in `u` the sum of the members' weights, kept with every member added or removed, and in `c`
-- the key's capacity, so that no call reads every holder: an acquire among thousands of readers costs what one among three does (O(log n), plus
-- the dead it drops). Dead holders are dropped (their weights taken off the sum) by every call
-- that counts, so a holder that died frees its weight at its TTL. Both keys live as long as the
-- longest lease. A sum key that is missing while the set is there (evicted, or a set written
-- before it existed) is counted again from the members, once. Holders are admitted while the
-- live weights, theirs included, sum to at most the capacity; an acquire that names another
-- capacity than the key's holders did is refused (`counted_mismatch`), never admitted by its
-- own count. The hand-off queue is the plain lock's (`handoff.lua`), its entries
-- carrying the waiter's weight (8 hex digits) between its stamp and its channel; the head of
-- the queue waits until its whole weight fits, and nobody behind it is served before it.
local WEIGHT_LEN = 8

local counted_clock
-- The server's time in ms, read once per script run.
local function counted_now()
  if not counted_clock then
    local now = redis.call('TIME')
    counted_clock = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  end
  return counted_clock
end

-- A key taken with a share that holds something else: a plain lease (a string: a lock taken
-- without counts), or a value that is no lock. Every user of a key takes it the same way, so
-- this is an error, not a wait (`WRONGTYPE`, as Redis answers a plain script on a sorted set).
local function counted_wrong(kind)
  if kind == 'string' then
    error({err = 'WRONGTYPE tower-lock: a plain lease holds this key, which this lease takes '
      .. 'with a share (permits, shared or exclusive): every user of a key must take it the '
      .. 'same way'})
  end
  error({err = 'WRONGTYPE tower-lock: this key holds a ' .. kind .. ', not a lock'})
end

-- An acquire naming capacity `asked` of a key its holders took with capacity `known`: refused,
-- as a key taken both ways is, so that no user's count admits more holders than another's.
local function counted_mismatch(known, asked)
  error({err = 'WRONGTYPE tower-lock: this key\'s holders took it with a capacity of '
    .. string.format('%d', known) .. ' and this lease names ' .. string.format('%d', asked)
    .. ': every user of a key must name the same number of permits'})
end

-- The counted keys this script run found with no holder (`counted_used`), by name, until
-- `counted_hold` adds their first.
local counted_fresh = {}

-- The key holding the sum of `lock`'s members' weights: the role `weight:` after the lock key's
-- hash tag (a lock key's prefix has no braces, so its first '}' ends the tag).
local function counted_sum_key(lock)
  local tag_end = string.find(lock, '}', 1, true)
  return string.sub(lock, 1, tag_end) .. 'weight:' .. string.sub(lock, tag_end + 1)
end

-- The weight a member (`token:weight`) takes.
local function counted_weight(member)
  return tonumber(string.sub(member, string.find(member, ':', 1, true) + 1))
end

-- Writes `lock`'s sum key afresh: `used`, of capacity `cap`, for `ms` (over a sum left by a
-- version that kept it as a string, too).
local function counted_write_sum(sum_key, used, cap, ms)
  if type(redis.pcall('HSET', sum_key, 'u', used, 'c', cap)) == 'table' then
    redis.call('DEL', sum_key)
    redis.call('HSET', sum_key, 'u', used, 'c', cap)
  end
  redis.call('PEXPIRE', sum_key, ms)
end

-- `lock`'s sum counted from its members (O(n)): for a sum key that is missing. Kept as long as
-- the set, with capacity `cap`.
local function counted_recount(lock, sum_key, cap)
  local used = 0
  for _, member in ipairs(redis.call('ZRANGE', lock, 0, -1)) do
    used = used + counted_weight(member)
  end
  if used > 0 then
    counted_write_sum(sum_key, used, cap, math.max(redis.call('PTTL', lock), 1))
  end
  return used
end

-- The weight `lock`'s live holders take, once the dead are dropped (and their weights taken off
-- the sum); an error when the key holds anything but a lease with a share (`counted_wrong`), or,
-- with `check`, when its holders took it with another capacity than `cap` (`counted_mismatch`).
local function counted_used(lock, now, cap, check)
  local kind = redis.call('TYPE', lock).ok
  local sum_key = counted_sum_key(lock)
  if kind == 'none' then
    -- No holder: the first one `counted_hold` adds writes the sum afresh (over a sum left
    -- without its set, deleted or evicted alone, which must not count).
    counted_fresh[lock] = true
    return 0
  elseif kind ~= 'zset' then
    counted_wrong(kind)
  end
  -- Both keys are read before anything is written: the sum key is derived here, not declared,
  -- so on a cluster slot being resharded it may have moved without the set, and Redis refuses
  -- the access then; refused before any write, the call leaves both keys as they were.
  local sum = redis.pcall('HMGET', sum_key, 'u', 'c')
  if sum.err then
    if not string.find(sum.err, 'WRONGTYPE', 1, true) then
      error(sum)
    end
    -- A sum written by a version before capacities were kept: counted again below.
    sum = {false, false}
    redis.call('DEL', sum_key)
  end
  local used, known = tonumber(sum[1]), tonumber(sum[2])
  if check and known and known ~= tonumber(cap) then
    counted_mismatch(known, tonumber(cap))
  end
  local dead = redis.call('ZRANGEBYSCORE', lock, '-inf', now)
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', lock, '-inf', now)
  end
  if not used then
    return counted_recount(lock, sum_key, cap)
  end
  if #dead > 0 then
    local gone = 0
    for _, member in ipairs(dead) do
      gone = gone + counted_weight(member)
    end
    used = redis.call('HINCRBY', sum_key, 'u', -gone)
    if used <= 0 then
      redis.call('DEL', sum_key)
      used = 0
    end
  end
  return used
end

-- Holds `member` for `ms` from `now` (a new member's weight added to the sum of a key of
-- capacity `cap`; a renewal adds none and names none); the key and its sum live at least that
-- long. (A sum `HINCRBY` creates is recounted at once, and takes the set's expiry.)
local function counted_hold(lock, member, now, ms, cap)
  local sum_key = counted_sum_key(lock)
  if counted_fresh[lock] then
    -- The set's first member (`counted_used` found no key): set and sum start here.
    counted_fresh[lock] = nil
    redis.call('ZADD', lock, now + ms, member)
    redis.call('PEXPIRE', lock, ms)
    counted_write_sum(sum_key, counted_weight(member), cap, ms)
    return
  end
  if redis.call('ZADD', lock, now + ms, member) == 1 then
    local weight = counted_weight(member)
    if redis.call('HINCRBY', sum_key, 'u', weight) == weight then
      -- The sum key was missing (a sum is deleted at 0): count the members, and keep the
      -- capacity.
      redis.call('DEL', sum_key)
      counted_recount(lock, sum_key, cap)
    end
  end
  if redis.call('PTTL', lock) < ms then
    redis.call('PEXPIRE', lock, ms)
    redis.call('PEXPIRE', sum_key, ms)
  end
end

-- Takes `member` off `lock` and its weight off the sum. Returns its score (false if absent).
-- The sum first: a sum key Redis refuses (moved without its set, see `counted_used`) stops the
-- call before the set is written.
local function counted_drop(lock, member)
  local score = redis.call('ZSCORE', lock, member)
  if score then
    local sum_key = counted_sum_key(lock)
    if redis.call('HINCRBY', sum_key, 'u', -counted_weight(member)) <= 0 then
      redis.call('DEL', sum_key)
    end
    redis.call('ZREM', lock, member)
  end
  return score
end

-- When a waiter should check again if told nothing: when the first live lease ends (ms).
local function counted_next(lock, now)
  if redis.call('TYPE', lock).ok ~= 'zset' then
    return redis.call('PTTL', lock)
  end
  local first = redis.call('ZRANGE', lock, 0, 0, 'WITHSCORES')
  if first[2] then
    return math.max(tonumber(first[2]) - now, 1)
  end
  return -2
end

-- Serves `queue` in order while the head's weight fits in `cap` beside `used`: each live waiter
-- served is held for the claim window and told ('g' token stamp claim ':' fence, as a plain
-- hand-off); a waiter whose process is gone is dropped; a head that does not fit stops it (no
-- one overtakes it). An entry of `mine` (a queued caller) at the head ends it too: returns
-- true when the caller's weight fits (its entry taken out; the caller takes the key). Returns
-- the weight used after, and that.
local function counted_serve(lock, fence_key, queue, toklen, cap, used, now, claim, retention, mine)
  while true do
    local head = redis.call('LINDEX', queue, 0)
    if not head then
      return used, false
    end
    local id_len = toklen + STAMP_LEN
    local weight = tonumber(string.sub(head, id_len + 1, id_len + WEIGHT_LEN), 16) or cap + 1
    local tok = string.sub(head, 1, toklen)
    if tok == mine then
      if used + weight > cap then
        return used, false
      end
      redis.call('LPOP', queue)
      return used, true
    end
    local channel = string.sub(head, id_len + WEIGHT_LEN + 1)
    if redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
      redis.call('LPOP', queue)
    elseif used + weight > cap then
      return used, false
    else
      redis.call('LPOP', queue)
      local fence = new_fence(fence_key, retention)
      counted_hold(lock, tok .. ':' .. weight, now, tonumber(claim), cap)
      redis.call('PUBLISH', channel,
        'g' .. string.sub(head, 1, id_len) .. claim .. ':' .. string.format('%d', fence))
      used = used + weight
    end
  end
end

-- Takes `weight` of `lock`'s capacity `cap` for `token`; arguments and answers as `acquire`'s
-- (codes 1, 0, 2, 3), the number with 0, 2 and 3 the ms until the first live lease ends.
local function counted_acquire(lock, fence_key, queue, token, weight, cap, ttl, retention, claim,
                               stamp, channel, rescan)
  local now = counted_now()
  weight, cap, ttl = tonumber(weight), tonumber(cap), tonumber(ttl)
  local used = counted_used(lock, now, cap, true)
  local member = token .. ':' .. weight
  if redis.call('ZSCORE', lock, member) then
    -- Handed to the caller by a release, or taken by this same acquire sent before: claimed for
    -- the full TTL, with a fencing token of its own.
    counted_hold(lock, member, now, ttl, cap)
    if queue then
      leave(queue, token)
    end
    return 1, new_fence(fence_key, retention)
  end
  if queue and redis.call('LLEN', queue) > 0 then
    local mine
    used, mine = counted_serve(lock, fence_key, queue, #token, cap, used, now, claim, retention,
      token)
    if mine then
      leave(queue, token)
      counted_hold(lock, member, now, ttl, cap)
      return 1, new_fence(fence_key, retention)
    end
  end
  if (not queue or redis.call('LLEN', queue) == 0) and used + weight <= cap then
    counted_hold(lock, member, now, ttl, cap)
    return 1, new_fence(fence_key, retention)
  end
  if not queue or channel == '' then
    return 0, counted_next(lock, now)
  end
  if redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
    return 3, counted_next(lock, now)
  end
  local queued = false
  if rescan == '1' then
    local toklen = #token
    for _, e in ipairs(redis.call('LRANGE', queue, 0, -1)) do
      if string.sub(e, 1, toklen) == token then
        queued = true
        break
      end
    end
  end
  if not queued then
    redis.call('RPUSH', queue, token .. stamp .. string.format('%08x', weight) .. channel)
  end
  local keep = 2 * math.max(ttl, redis.call('PTTL', lock)) + tonumber(claim)
  if redis.call('PTTL', queue) < keep then
    redis.call('PEXPIRE', queue, keep)
  end
  return 2, counted_next(lock, now)
end

-- Gives `token`'s `weight` of `lock` back, and serves the queue with what is free; a waiter that
-- gives up leaves the queue. Returns 1 when a live lease was released, else 0.
local function counted_release(lock, fence_key, queue, token, weight, cap, claim, retention)
  local now = counted_now()
  local score = counted_drop(lock, token .. ':' .. weight)
  if not score then
    if queue then
      leave(queue, token)
    end
    return 0
  end
  if queue and redis.call('LLEN', queue) > 0 then
    local used = counted_used(lock, now, cap, false)
    counted_serve(lock, fence_key, queue, #token, tonumber(cap), used, now, claim, retention, nil)
  end
  if tonumber(score) > now then
    return 1
  end
  return 0
end

-- Extends `token`'s lease on `lock` to `ttl` ms. Returns 1 when extended, 0 when it is not live.
local function counted_renew(lock, token, weight, ttl)
  local member = token .. ':' .. weight
  local score = redis.call('ZSCORE', lock, member)
  local now = counted_now()
  if score and tonumber(score) > now then
    counted_hold(lock, member, now, tonumber(ttl))
    return 1
  end
  return 0
end

