-- Record a worker as alive for ARGV[2] ms with ARGV[3] runs held; forget workers past their time.
-- KEYS[1] live workers (sorted set), KEYS[2] runs held (hash); ARGV[1] worker id
-- Redis's clock, not the worker's, so that workers on hosts whose clocks differ agree.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(gone))
end
return 1
