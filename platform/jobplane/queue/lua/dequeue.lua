-- Remove a run from both the ready and the delayed set of its queue.
-- KEYS[1] ready set, KEYS[2] delayed set; ARGV[1] run id, ARGV[2] delayed member
return redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[2], ARGV[2])
