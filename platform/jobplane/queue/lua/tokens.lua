-- The fencing tokens of locks: a counter Redis hands out from blocks MongoDB allots, so tokens
-- keep growing across a Redis wipe. KEYS[1] the counter (a hash: incarnation, next, ceiling)
-- ARGV[1] 'incarnation': name this Redis's counter ARGV[2] unless it has a name; returns its
-- name. ARGV[1] 'block': with ARGV[2] the incarnation the block was allotted for, ARGV[3] its
-- first token and ARGV[4] its end: take it if it is newer than the block held; returns 1, or 0
-- when the counter's name is another (Redis was wiped since: the block may be stale).
if ARGV[1] == 'incarnation' then
  redis.call('HSETNX', KEYS[1], 'incarnation', ARGV[2])
  return redis.call('HGET', KEYS[1], 'incarnation')
end
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[2] then return 0 end
local ceiling = tonumber(redis.call('HGET', KEYS[1], 'ceiling') or '0')
if ceiling < tonumber(ARGV[4]) then
  local next = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
  redis.call('HSET', KEYS[1], 'next', math.max(next, tonumber(ARGV[3])), 'ceiling', ARGV[4])
end
return 1
