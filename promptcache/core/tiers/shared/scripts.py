"""The shared tier's Lua scripts (key layout in ``index``): put, delete, lookup, tag.

Each runs atomically on the server and touches only one namespace's slot (``{M:R}``), except the
optional value and session-set keys, which the put and tag scripts take only from standalone
servers (in cluster mode the writer sends those separately). ``SHAS`` maps a script to its SHA1
for EVALSHA.
"""

from __future__ import annotations

import hashlib

# Lua helpers: drop the 16-byte id ``x`` from the packed ids in field ``f`` of hash ``h`` (a
# child list, a block's tags); drop ``x`` from its parent's child list; add session ids to a
# block's tags (bounded: past ``maxn`` a block counts as shared anyway, as in RAM).
_FUNCS = """
local function drop_id(h, f, x)
  local cur = redis.call('HGET', h, f)
  if cur then
    local keep = {}
    for i = 1, #cur, 16 do
      local k = string.sub(cur, i, i + 15)
      if k ~= x then keep[#keep + 1] = k end
    end
    if #keep == 0 then redis.call('HDEL', h, f) else redis.call('HSET', h, f, table.concat(keep)) end
  end
end
local function unlink(c, x, entry)
  drop_id(c, string.sub(entry, 1, 20), x)
end
local function add_tags(t, h, sids, maxn)
  local cur = redis.call('HGET', t, h) or ''
  for _, s in ipairs(sids) do
    local found = false
    for i = 1, #cur, 16 do
      if string.sub(cur, i, i + 15) == s then found = true; break end
    end
    if not found and #cur < maxn * 16 then cur = cur .. s end
  end
  if #cur > 0 then redis.call('HSET', t, h, cur) end
end
"""

# KEYS: entries, child lists, recency, tags[, value][, session sets]. ARGV: hash, packed entry,
# now (ms), ttl (ms), sweep limit, 1 when a value key is given, value, namespace root, max tags,
# session ids (one per session set key when those are given). A value and session sets are
# given by standalone servers only (their keys lie in other cluster slots): then the value, its
# entry and its tags are written in one atomic step; in cluster mode the writer SETs the value
# first and adds the session sets after. A new entry joins its parent's child list. Then stale
# entries (unused for a ttl: their values have expired too) are swept, a few per put, with their
# tags, and the index keys' TTL refreshed: an abandoned namespace's index expires with its
# values. Returns the swept blocks as hash + parent (32 bytes each), for the eviction log.
PUT_LUA = (
    _FUNCS
    + """
local m, c, z, t = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local h, meta, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local nv = tonumber(ARGV[6])
if nv == 1 then redis.call('SET', KEYS[5], ARGV[7], 'PX', ttl) end
local old = redis.call('HGET', m, h)
if old and string.sub(old, 1, 20) ~= string.sub(meta, 1, 20) then unlink(c, h, old); old = false end
redis.call('HSET', m, h, meta)
if not old then
  local f = string.sub(meta, 1, 20)
  local kids = redis.call('HGET', c, f) or ''
  local found = false
  for i = 1, #kids, 16 do
    if string.sub(kids, i, i + 15) == h then found = true; break end
  end
  if not found then redis.call('HSET', c, f, kids .. h) end
end
redis.call('ZADD', z, now, h)
local sids = {}
for i = 10, #ARGV do sids[#sids + 1] = ARGV[i] end
if #sids > 0 then
  add_tags(t, h, sids, tonumber(ARGV[9]))
  for i = 5 + nv, #KEYS do
    redis.call('SADD', KEYS[i], ARGV[8] .. h); redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
local swept = {}
local stale = redis.call('ZRANGEBYSCORE', z, '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[5]))
for _, x in ipairs(stale) do
  local e = redis.call('HGET', m, x)
  if e then unlink(c, x, e); redis.call('HDEL', m, x); swept[#swept + 1] = x .. string.sub(e, 1, 16) end
  redis.call('ZREM', z, x)
  redis.call('HDEL', t, x)
end
redis.call('PEXPIRE', m, ttl); redis.call('PEXPIRE', z, ttl)
if redis.call('EXISTS', t) == 1 then redis.call('PEXPIRE', t, ttl) end
return swept
"""
)

# KEYS: entries, tags[, session sets]. ARGV: ttl (ms), namespace root, max tags, number of
# session ids n, n session ids, then block hashes. Tags the hashes that have an entry (a block
# not written yet carries its tags in its put); returns those, for the cluster writer's SADD.
TAG_LUA = (
    _FUNCS
    + """
local m, t = KEYS[1], KEYS[2]
local ttl, root, maxn, n = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local sids = {}
for i = 5, 4 + n do sids[#sids + 1] = ARGV[i] end
local done = {}
for i = 5 + n, #ARGV do
  local h = ARGV[i]
  if redis.call('HEXISTS', m, h) == 1 then
    add_tags(t, h, sids, maxn)
    done[#done + 1] = h
    for k = 3, #KEYS do redis.call('SADD', KEYS[k], root .. h) end
  end
end
if #done > 0 then
  redis.call('PEXPIRE', t, ttl)
  for k = 3, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
end
return done
"""
)

# KEYS: tags. ARGV: session id, block hashes. Removes the id from those blocks' tags.
UNTAG_LUA = (
    _FUNCS
    + """
local t, s = KEYS[1], ARGV[1]
for i = 2, #ARGV do drop_id(t, ARGV[i], s) end
return 0
"""
)

# KEYS: entries, child lists, recency, tags. ARGV: hashes. Removes entries (their child links
# and tags too).
DELETE_LUA = (
    _FUNCS
    + """
local m, c, z, t = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = 0
for _, h in ipairs(ARGV) do
  local e = redis.call('HGET', m, h)
  if e then
    unlink(c, h, e)
    redis.call('HDEL', m, h)
    n = n + 1
  end
  redis.call('ZREM', z, h)
  redis.call('HDEL', t, h)
end
return n
"""
)

# KEYS: entries, child lists. ARGV: parent, expected hashes (16 bytes each, concatenated), the
# first token (4 bytes each) at each block boundary from the start on. Returns
# {matched, h1, e1, ..., hk, ek, child1, centry1, ...}: the whole blocks whose entry names the
# previous hash as parent, then the children of the last under the next first token.
LOOKUP_LUA = """
local m, c = KEYS[1], KEYS[2]
local parent, hs, toks = ARGV[1], ARGV[2], ARGV[3]
local out = {0}
local i = 0
while i * 16 < #hs do
  local h = string.sub(hs, i * 16 + 1, i * 16 + 16)
  local e = redis.call('HGET', m, h)
  if not e or string.sub(e, 1, 16) ~= parent then break end
  out[#out + 1] = h; out[#out + 1] = e
  parent = h; i = i + 1
end
out[1] = i
local tok = string.sub(toks, i * 4 + 1, i * 4 + 4)
if #tok == 4 then
  local kids = redis.call('HGET', c, parent .. tok)
  if kids then
    for j = 1, #kids, 16 do
      local k = string.sub(kids, j, j + 15)
      local e = redis.call('HGET', m, k)
      if e then out[#out + 1] = k; out[#out + 1] = e end
    end
  end
end
return out
"""

SHAS = {
    s: hashlib.sha1(s.encode()).hexdigest()
    for s in (PUT_LUA, TAG_LUA, UNTAG_LUA, DELETE_LUA, LOOKUP_LUA)
}
