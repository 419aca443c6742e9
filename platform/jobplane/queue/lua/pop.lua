-- Promote due delayed runs into their lanes, then pop up to N ready run ids: queue by queue in
-- order, skipping paused queues, and within a queue its lanes' runs merged in the order one
-- sorted set would give (score, that is -priority, then id); a fair lane's runs come out by
-- its ring (fair.lua, prepended), in turns across groups within a priority. Each popped run
-- with a rate limit then passes its window (rate.lua, prepended): one over it goes back to its
-- lane's delayed set, due when the window allows.
-- KEYS[1] the pause mirror (hash), KEYS[2] the ring turn counter, then per lane its ready set,
-- delayed set, ring, bell and rated set, the lanes of each queue together
-- ARGV[1] now (epoch ms), ARGV[2] how many to pop, ARGV[3] most delayed runs to promote per
-- lane, ARGV[4] what the keys of rate windows begin with, then per queue its name and how
-- many lanes it has, in order
-- Returns {popped members, earliest delayed due time in ms ("" when none), paused queues,
-- 1 if the pause mirror is loaded, {run id, 0 or -1 (rate.lua)} flat for each popped run
-- whose window was taken, {member, due time} flat for each run its window refused}. Until
-- the pause mirror is loaded (a new or wiped Redis) nothing is popped: the caller loads it
-- from MongoDB and pops again.
local paused_key, turn_key = KEYS[1], KEYS[2]
local now, n, limit, rates = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local loaded = redis.call('HEXISTS', paused_key, '_loaded') == 1
local LANE = 5

local next_due, next_due_text = nil, ''

-- Promote a lane's due delayed runs into its ready set, rated set or fair groups.
local function promote(ready, delayed, ring, bell, rated)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, limit)) do
    -- <member>|<priority>, or <member>|<priority>|<group key> in a fair lane
    local first = string.find(member, '|', 1, true)
    local second = string.find(member, '|', first + 1, true)
    local id = string.sub(member, 1, first - 1)
    if second then
      local priority = tonumber(string.sub(member, first + 1, second - 1))
      enter(ring, string.sub(member, second + 1), bell, turn_key, id, priority)
    elseif window_of(id) then
      -- As `RedisQueue.push` places it: out of reach of a blocking pop, its bell rung.
      local score = -tonumber(string.sub(member, first + 1))
      redis.call('ZADD', rated, score, id)
      redis.call('ZADD', bell, score, id)
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

-- A worker offers many handlers, and most of its lanes are empty: one EXISTS says so, and an
-- empty lane costs the pop nothing more.
local empty = {}
for i = 3, #KEYS, LANE do
  empty[i] = redis.call('EXISTS', KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 4]) == 0
  if not empty[i] then
    promote(KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3], KEYS[i + 4])
  end
end

-- A popped run: {member, its lane's delayed set, its score, its fair group's key or false}.
local function taken(member, delayed, score, group)
  return {member, delayed, tonumber(score), group or false}
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

local function set_head(set)
  local run = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  if run[1] then return {tonumber(run[2]), run[1]} end
  return nil
end

local function before(a, b)
  return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2])
end

-- Pop `want` runs from the lanes of one queue (their first keys' indexes), where some
-- (`mixed`, the same indexes) hold fair or rated runs: the heads of every ready set, and of
-- those lanes' rated sets and rings, compared run by run.
local function pop_merged(lanes, mixed, want, result)
  local sources = {}
  for _, i in ipairs(lanes) do
    local delayed, bell = KEYS[i + 1], KEYS[i + 3]
    sources[#sources + 1] = {set = KEYS[i], delayed = delayed, head = set_head(KEYS[i])}
    if mixed[i] then
      sources[#sources + 1] = {set = KEYS[i + 4], delayed = delayed, bell = bell, head = set_head(KEYS[i + 4])}
      sources[#sources + 1] = {ring = KEYS[i + 2], delayed = delayed, bell = bell, head = fair_head(KEYS[i + 2])}
    end
  end
  for _ = 1, want do
    local best = nil
    for _, source in ipairs(sources) do
      if source.head and (best == nil or before(source.head, best.head)) then best = source end
    end
    if best == nil then return end
    local score, id = best.head[1], best.head[2]
    if best.set then
      result[#result + 1] = taken(id, best.delayed, score)
      redis.call('ZREM', best.set, id)
      if best.bell then redis.call('ZREM', best.bell, id) end
      best.head = set_head(best.set)
    else
      local group = best.head[3]
      result[#result + 1] = taken(id, best.delayed, score, group)
      redis.call('ZREM', group, id)
      redis.call('ZREM', best.bell, rung(id, group))
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
local k, q = 3, 5
while q <= #ARGV do
  local name, lanes = ARGV[q], tonumber(ARGV[q + 1])
  local want = n - #result
  local mirrored = loaded and redis.call('HGET', paused_key, name)
  if mirrored and string.sub(mirrored, -2) == ':1' then
    paused[#paused + 1] = name
  elseif loaded and want > 0 then
    local live, mixed, merged = {}, {}, false
    for l = 0, lanes - 1 do
      local lane = k + LANE * l
      if not empty[lane] then
        live[#live + 1] = lane
        if redis.call('EXISTS', KEYS[lane + 2], KEYS[lane + 4]) > 0 then
          mixed[lane], merged = true, true
        end
      end
    end
    if merged then
      pop_merged(live, mixed, want, result)
    elseif #live == 1 then
      local popped = redis.call('ZPOPMIN', KEYS[live[1]], want)
      for j = 1, #popped, 2 do
        result[#result + 1] = taken(popped[j], KEYS[live[1] + 1], popped[j + 1])
      end
    elseif #live > 1 then
      local heads = {}
      for _, lane in ipairs(live) do
        local top = redis.call('ZRANGE', KEYS[lane], 0, want - 1, 'WITHSCORES')
        for j = 1, #top, 2 do
          heads[#heads + 1] = {tonumber(top[j + 1]), top[j], KEYS[lane], KEYS[lane + 1]}
        end
      end
      table.sort(heads, before)
      for j = 1, math.min(want, #heads) do
        redis.call('ZREM', heads[j][3], heads[j][2])
        result[#result + 1] = taken(heads[j][2], heads[j][4], heads[j][1])
      end
    end
  end
  k = k + LANE * lanes
  q = q + 2
end

-- Each popped run passes its rate window, if it has one (a run pushed before its lane kept
-- rated runs apart may come from a ready set too).
local popped, windows, refused = {}, {}, {}
for _, run in ipairs(result) do
  local member = run[1]
  local window = window_of(member)
  local at = 0
  if window then
    at = window_take(rates, tonumber(now), window[2], window[3], window[4], window[1])
  end
  if at > 0 then
    local back = member .. '|' .. string.format('%d', -run[3]) .. (run[4] and ('|' .. run[4]) or '')
    redis.call('ZADD', run[2], at, back)
    refused[#refused + 1] = member
    refused[#refused + 1] = at
    if next_due == nil or at < next_due then
      next_due, next_due_text = at, string.format('%d', at)
    end
  else
    popped[#popped + 1] = member
    if window then
      windows[#windows + 1] = window[1]
      windows[#windows + 1] = at
    end
  end
end
return {popped, next_due_text, paused, loaded and 1 or 0, windows, refused}
