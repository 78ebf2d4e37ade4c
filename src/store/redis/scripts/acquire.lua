-- Takes a lock if it is free, and hands out a fencing token; with hand-off on (`queue` given),
-- respects the queue.
-- `lock`: the lock key. `fence_key`: the fencing counter of its hash slot. `queue`: the lock
-- key's queue, or nil without hand-off. `token`: the caller's token. `ttl`: time to live in ms.
-- `retention`: the counter's retention in ms. With hand-off: `claim`: the claim window in ms;
-- `stamp`: the caller's stamp; `channel`: the caller's channel, or '' to not queue (a caller that
-- will not wait, or cannot hear the hand-off); `rescan`: '1' if the caller may be queued already
-- (a later attempt), else '0'.
-- Returns 1 and a fencing token when acquired (or a hand-off to the caller claimed, or the key
-- found held with the caller's own token: the same acquire sent again), 0 and the remaining ttl
-- in ms when held by someone else, 2 and ms when held and the caller is queued (check again
-- within that many ms if told nothing), 3 and ms when held and the caller not queued because
-- nobody is subscribed to its channel on this server.
local function acquire(lock, fence_key, queue, token, ttl, retention, claim, stamp, channel, rescan)
  local took = redis.call('SET', lock, token, 'NX', 'PX', ttl)
  if took and (not queue or redis.call('LLEN', queue) == 0) then
    -- The usual case: free, and nobody waits.
    return 1, new_fence(fence_key, retention)
  end
  if not queue then
    if redis.call('GET', lock) == token then
      -- Held with the caller's own token: this acquire was sent again (its reply was lost and
      -- the client re-sent it, or `SentinelStore` ran it again on a new master that had it
      -- replicated). The caller holds the key: renewed to the full time to live, with a fencing
      -- token of its own (higher than the one whose answer was lost).
      redis.call('PEXPIRE', lock, ttl)
      return 1, new_fence(fence_key, retention)
    end
    return 0, redis.call('PTTL', lock)
  end
  local toklen = #token
  if took then
    local head = redis.call('LINDEX', queue, 0)
    if string.sub(head, 1, toklen) == token then
      -- Free, and the caller is first in line.
      leave(queue, token)
      return 1, new_fence(fence_key, retention)
    end
    -- Free, but others wait (a holder's lease ran out, or a hand-off went unclaimed): the key
    -- goes to the first live waiter (overwriting the caller's SET), not to the caller. Unless
    -- none of them is alive, or the caller's own entry comes before any live one: then the
    -- caller's SET stands.
    if hand_over(lock, fence_key, queue, claim, retention, token, true) ~= 'handed' then
      leave(queue, token)
      return 1, new_fence(fence_key, retention)
    end
    if channel == '' then
      return 0, tonumber(claim)
    end
  elseif redis.call('GET', lock) == token then
    -- Handed to the caller by a release, or taken by this same acquire sent before (a re-sent
    -- request): claim it for the full time to live, with a fencing token of its own (higher than
    -- the one the hand-off announced or the lost answer carried, which the caller only uses when
    -- it did not send this).
    redis.call('PEXPIRE', lock, ttl)
    leave(queue, token)
    return 1, new_fence(fence_key, retention)
  elseif channel == '' then
    return 0, redis.call('PTTL', lock)
  end
  -- Queued only where the caller's process listens: until its store's subscription has followed a
  -- failover (or an address that moved to another server), it is subscribed elsewhere, and a
  -- release here would take its entry for a dead waiter's.
  if redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
    return 3, redis.call('PTTL', lock)
  end
  -- A later attempt looks for the caller's entry first: it keeps its place if it has one, and is
  -- queued (again) if not (a release skipped it, a hand-off to it went unclaimed, or its entry
  -- never reached this server: a master promoted by a failover has only what its replica had).
  local queued = false
  if rescan == '1' then
    for _, e in ipairs(redis.call('LRANGE', queue, 0, -1)) do
      if string.sub(e, 1, toklen) == token then
        queued = true
        break
      end
    end
  end
  if not queued then
    redis.call('RPUSH', queue, token .. stamp .. channel)
  end
  -- The queue outlives its waiters' checks (each checks again within the holder's TTL); only
  -- ever extended, so a waiter with a short TTL does not cut it short for the others.
  local keep = 2 * math.max(tonumber(ttl), redis.call('PTTL', lock)) + tonumber(claim)
  if redis.call('PTTL', queue) < keep then
    redis.call('PEXPIRE', queue, keep)
  end
  return 2, redis.call('PTTL', lock)
end

