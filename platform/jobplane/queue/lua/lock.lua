-- Take owner-checked locks, all or none, or extend them for the owner that holds them.
-- A lock's value is its owner, then (a resource lock) a newline and its fencing token.
-- KEYS the locks, then (with tokens) the token counter (a hash: incarnation, next, ceiling)
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] 1 to hand out fencing tokens
-- Returns {1, token, ...} (one per lock; "" without tokens) when the caller holds them all now;
-- {0, index of a lock another owner holds, its value} when it does not; {-1} when the token
-- counter is missing (a new or wiped Redis) and {-2} when its block of tokens is spent: the
-- caller refills it from MongoDB (tokens.lua) and asks again.
local owner, ttl, tokens = ARGV[1], ARGV[2], ARGV[3] == '1'
local locks = #KEYS - (tokens and 1 or 0)
local function owner_of(value)
  local cut = string.find(value, '\n', 1, true)
  return cut and string.sub(value, 1, cut - 1) or value
end
local values, new = {}, 0
for i = 1, locks do
  local value = redis.call('GET', KEYS[i])
  if value and owner_of(value) ~= owner then
    return {0, i, value}
  end
  values[i] = value
  if not value then new = new + 1 end
end
local counter = KEYS[locks + 1]
if tokens and new > 0 then
  local state = redis.call('HMGET', counter, 'next', 'ceiling')
  if not state[2] then return {-1} end
  if tonumber(state[1] or 0) + new > tonumber(state[2]) then return {-2} end
end
local result = {1}
for i = 1, locks do
  local value = values[i]
  if value then
    redis.call('PEXPIRE', KEYS[i], ttl)
    local cut = string.find(value, '\n', 1, true)
    result[#result + 1] = cut and string.sub(value, cut + 1) or ''
  else
    local token = ''
    if tokens then token = tostring(redis.call('HINCRBY', counter, 'next', 1)) end
    redis.call('SET', KEYS[i], tokens and (owner .. '\n' .. token) or owner, 'PX', ttl)
    result[#result + 1] = token
  end
end
return result
