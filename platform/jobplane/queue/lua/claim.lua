-- Promote due delayed runs into their lanes' ready sets, then pop up to N ready run ids:
-- queue by queue in order, and within a queue its lanes' runs merged in the order one sorted
-- set would give (score, that is -priority, then id).
-- KEYS: per lane its ready set then its delayed set, the lanes of each queue together
-- ARGV[1] now (epoch ms), ARGV[2] how many to pop, ARGV[3] most delayed runs to promote per
-- lane, ARGV[4..] how many lanes each queue has, in order
-- Returns the popped ids followed by the earliest delayed due time in ms ("" when none).
local now, n, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local next_due, next_due_text = nil, ''
for i = 1, #KEYS, 2 do
  local ready, delayed = KEYS[i], KEYS[i + 1]
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, limit)) do
    local sep = string.find(member, '|', 1, true)
    redis.call('ZADD', ready, -tonumber(string.sub(member, sep + 1)), string.sub(member, 1, sep - 1))
    redis.call('ZREM', delayed, member)
  end
  local first = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
  if first[2] and (next_due == nil or tonumber(first[2]) < next_due) then
    next_due, next_due_text = tonumber(first[2]), first[2]
  end
end
local result = {}
local k = 1
for q = 4, #ARGV do
  local lanes = tonumber(ARGV[q])
  local want = n - #result
  if want > 0 and lanes == 1 then
    local popped = redis.call('ZPOPMIN', KEYS[k], want)
    for j = 1, #popped, 2 do
      result[#result + 1] = popped[j]
    end
  elseif want > 0 then
    local heads = {}
    for l = 0, lanes - 1 do
      local key = KEYS[k + 2 * l]
      local top = redis.call('ZRANGE', key, 0, want - 1, 'WITHSCORES')
      for j = 1, #top, 2 do
        heads[#heads + 1] = {tonumber(top[j + 1]), top[j], key}
      end
    end
    table.sort(heads, function(a, b)
      if a[1] ~= b[1] then return a[1] < b[1] end
      return a[2] < b[2]
    end)
    for j = 1, math.min(want, #heads) do
      redis.call('ZREM', heads[j][3], heads[j][2])
      result[#result + 1] = heads[j][2]
    end
  end
  k = k + 2 * lanes
end
result[#result + 1] = next_due_text
return result
