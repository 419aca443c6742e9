-- Promote due delayed runs into their lanes, then pop up to N ready run ids: queue by queue in
-- order, skipping paused queues, and within a queue its lanes' runs merged in the order one
-- sorted set would give (score, that is -priority, then id); a fair lane's runs come out by
-- its ring (fair.lua, prepended), in turns across groups within a priority.
-- KEYS[1] the pause mirror (hash), KEYS[2] the ring turn counter, then per lane its ready set,
-- delayed set, ring and bell, the lanes of each queue together
-- ARGV[1] now (epoch ms), ARGV[2] how many to pop, ARGV[3] most delayed runs to promote per
-- lane, then per queue its name and how many lanes it has, in order
-- Returns {popped ids, earliest delayed due time in ms ("" when none), paused queues,
-- 1 if the pause mirror is loaded}. Until it is (a new or wiped Redis) nothing is popped:
-- the caller loads it from MongoDB and pops again.
local paused_key, turn_key = KEYS[1], KEYS[2]
local now, n, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local loaded = redis.call('HEXISTS', paused_key, '_loaded') == 1

local next_due, next_due_text = nil, ''
for i = 3, #KEYS, 4 do
  local ready, delayed, ring, bell = KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3]
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, limit)) do
    -- <id>|<priority>, or <id>|<priority>|<group key> in a fair lane
    local first = string.find(member, '|', 1, true)
    local second = string.find(member, '|', first + 1, true)
    local id = string.sub(member, 1, first - 1)
    if second then
      local priority = tonumber(string.sub(member, first + 1, second - 1))
      enter(ring, string.sub(member, second + 1), bell, turn_key, id, priority)
    else
      redis.call('ZADD', ready, -tonumber(string.sub(member, first + 1)), id)
    end
    redis.call('ZREM', delayed, member)
  end
  local head = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
  if head[2] and (next_due == nil or tonumber(head[2]) < next_due) then
    next_due, next_due_text = tonumber(head[2]), head[2]
  end
end

-- The first run of a lane's fair part: {score, id, group}, or nil. Groups a cancel emptied
-- leave the ring here.
local function fair_head(ring)
  while true do
    local top = redis.call('ZRANGE', ring, 0, 0)
    if not top[1] then return nil end
    local run = redis.call('ZRANGE', top[1], 0, 0, 'WITHSCORES')
    if run[1] then return {tonumber(run[2]), run[1], top[1]} end
    redis.call('ZREM', ring, top[1])
  end
end

local function plain_head(ready)
  local run = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  if run[1] then return {tonumber(run[2]), run[1]} end
  return nil
end

local function before(a, b)
  return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2])
end

-- Pop `want` runs from lanes first..last of one queue, fair parts among them.
local function pop_fair(first, last, want, result)
  local sources = {}
  for i = first, last, 4 do
    sources[#sources + 1] = {ready = KEYS[i], head = plain_head(KEYS[i])}
    sources[#sources + 1] = {ring = KEYS[i + 2], bell = KEYS[i + 3], head = fair_head(KEYS[i + 2])}
  end
  for _ = 1, want do
    local best = nil
    for _, source in ipairs(sources) do
      if source.head and (best == nil or before(source.head, best.head)) then best = source end
    end
    if best == nil then return end
    local id = best.head[2]
    result[#result + 1] = id
    if best.ready then
      redis.call('ZREM', best.ready, id)
      best.head = plain_head(best.ready)
    else
      local group = best.head[3]
      redis.call('ZREM', group, id)
      redis.call('ZREM', best.bell, id)
      local rest = redis.call('ZRANGE', group, 0, 0, 'WITHSCORES')
      if rest[1] then
        redis.call('ZADD', best.ring, ring_score(turn_key, -tonumber(rest[2])), group)
      else
        redis.call('ZREM', best.ring, group)
      end
      best.head = fair_head(best.ring)
    end
  end
end

local result, paused = {}, {}
local k, q = 3, 4
while q <= #ARGV do
  local name, lanes = ARGV[q], tonumber(ARGV[q + 1])
  local want = n - #result
  local mirrored = loaded and redis.call('HGET', paused_key, name)
  if mirrored and string.sub(mirrored, -2) == ':1' then
    paused[#paused + 1] = name
  elseif loaded and want > 0 then
    local fair = false
    for l = 0, lanes - 1 do
      if redis.call('EXISTS', KEYS[k + 4 * l + 2]) == 1 then fair = true end
    end
    if fair then
      pop_fair(k, k + 4 * (lanes - 1), want, result)
    elseif lanes == 1 then
      local popped = redis.call('ZPOPMIN', KEYS[k], want)
      for j = 1, #popped, 2 do
        result[#result + 1] = popped[j]
      end
    else
      local heads = {}
      for l = 0, lanes - 1 do
        local key = KEYS[k + 4 * l]
        local top = redis.call('ZRANGE', key, 0, want - 1, 'WITHSCORES')
        for j = 1, #top, 2 do
          heads[#heads + 1] = {tonumber(top[j + 1]), top[j], key}
        end
      end
      table.sort(heads, before)
      for j = 1, math.min(want, #heads) do
        redis.call('ZREM', heads[j][3], heads[j][2])
        result[#result + 1] = heads[j][2]
      end
    end
  end
  k = k + 4 * lanes
  q = q + 2
end
return {result, next_due_text, paused, loaded and 1 or 0}
