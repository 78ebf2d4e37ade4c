-- Read an idempotency record.
-- KEYS[1]: the record key. Returns the encoded record, or nil.
return redis.call('GET', KEYS[1])
