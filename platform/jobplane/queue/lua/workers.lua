-- The live workers, the runs each holds and what each serves: a flat list of worker id,
-- count, offers (JSON), worker id, ...
-- KEYS[1] live workers (sorted set), KEYS[2] runs held (hash), KEYS[3] offers (hash)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local alive = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
local result = {}
if #alive == 0 then
  return result
end
local held = redis.call('HMGET', KEYS[2], unpack(alive))
local offers = redis.call('HMGET', KEYS[3], unpack(alive))
for i, id in ipairs(alive) do
  result[#result + 1] = id
  result[#result + 1] = held[i] or '0'
  result[#result + 1] = offers[i] or '{}'
end
return result
