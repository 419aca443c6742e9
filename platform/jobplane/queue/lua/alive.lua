-- Record a worker as alive for ARGV[2] ms with ARGV[3] runs held, serving what ARGV[4] says;
-- forget workers past their time.
-- KEYS[1] live workers (sorted set), KEYS[2] runs held (hash), KEYS[3] offers (hash);
-- ARGV[1] worker id, ARGV[4] JSON {queues, handlers}
-- Redis's clock, not the worker's, so that workers on hosts whose clocks differ agree.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(gone))
  redis.call('HDEL', KEYS[3], unpack(gone))
end
return 1
