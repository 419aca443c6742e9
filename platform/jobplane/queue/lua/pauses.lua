-- Copy queues' pauses from MongoDB into the mirror the pops read, each only if newer than the
-- copy there (a pause written while a stale full copy was on its way stays).
-- KEYS[1] the pause mirror (hash); ARGV[1] 1 when this is every queue MongoDB holds (the
-- mirror is then loaded), then per queue its name, its version and 1 (paused) or 0
for i = 2, #ARGV, 3 do
  local current = redis.call('HGET', KEYS[1], ARGV[i])
  local version = current and tonumber(string.match(current, '^(%d+):'))
  if not version or version < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1] .. ':' .. ARGV[i + 2])
  end
end
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], '_loaded', '1')
end
return 1
