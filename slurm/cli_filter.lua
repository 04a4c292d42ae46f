-- xmem-slurm's cli_filter for sbatch (Slurm 22.05+). Install it as `cli_filter.lua` in the directory of
-- slurm.conf, with `CliFilterPlugins=cli_filter/lua`, after filling in the @...@ settings below
-- (scripts/slurm-dev-cluster.sh shows how; slurm/README.md documents the contract).
--
-- It runs in sbatch, as the submitting user, on the submit host. It hands the job to `xmem-slurm filter`
-- (JSON in on stdin, JSON out on stdout; run as `python -I -m xmem.slurm.filter`, the same command without
-- the rest of the CLI, which keeps a cached resubmission fast; -I keeps the user's directory and PYTHON*
-- variables out of the filter's own imports) and applies what comes back: the options to set, one line for the
-- user, or a refusal. Whatever goes wrong on the way (crash, timeout, garbage) is an estimator fault: the
-- submission goes through unchanged with a one-line notice, unless the site chose fail-closed.

local XMEM_PYTHON = "@XMEM_PYTHON@"    -- the Python that has xmem-slurm installed (e.g. the venv's bin/python)
local XMEM_CONFIG = "@XMEM_CONFIG@"    -- the site config ("" = /etc/xmem/xmem.toml); a user's $XMEM_CONFIG never counts
local TIMEOUT_S = "@TIMEOUT_S@"        -- outer limit in seconds; the estimate's own limit is in the config
local FAILURE = "@FAILURE@"            -- "open" or "closed", used only when xmem-slurm cannot even say

local function notice(msg)
  io.stderr:write("xmem-slurm: " .. msg .. "\n")
end

-- What the user is told once Slurm has accepted the job (post-submit), so that "submitted unchanged" is never
-- printed for a job Slurm then refuses. The deferred-mode spool, and how the job waits for it travel in the same
-- store: "spool\nwaits\nmessage", where waits is "hold" (the user's own --hold: post-submit must not release such
-- a job), "begin" (not held: its start put off, xmem.slurm.putoff; nothing to release) or "".
local function keep_for_post_submit(message, spool, waits)
  slurm.cli_store(0, (spool or "") .. "\n" .. (waits or "") .. "\n" .. (message or ""))
end

-- The exit code of a finished os.execute: Lua 5.1 returns the wait status, later versions (ok, how, code).
local function exit_code(ok, how, code)
  if type(ok) == "number" then return ok >= 256 and math.floor(ok / 256) or ok end
  if ok == true then return 0 end
  return code or 1
end

local function shquote(s)
  return "'" .. string.gsub(s, "'", "'\\''") .. "'"
end

local function json_string(s)
  if s == nil then return "null" end
  s = string.gsub(tostring(s), '[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == "\\" then return "\\\\" end
    return string.format("\\u%04x", string.byte(c))
  end)
  return '"' .. s .. '"'
end

local function json_list(t)
  local parts = {}
  for _, v in ipairs(t or {}) do parts[#parts + 1] = json_string(v) end
  return "[" .. table.concat(parts, ",") .. "]"
end

local function readable(path)
  local f = path and io.open(path, "r")
  if not f then return false end
  f:close()
  return true
end

-- This sbatch's pid (Lua has no getpid): the first field of /proc/self/stat.
local function own_pid()
  local f = io.open("/proc/self/stat", "r")
  local pid = f and string.match(f:read("*l") or "", "^(%d+) ")
  if f then f:close() end
  return pid
end

local GPU_OPTIONS = {gres = true, gpus = true, ["gpus-per-node"] = true, ["gpus-per-task"] = true}

-- Sets the reply's options, the GPU request first. An option sbatch refuses to take (the setter raises) puts
-- back what was set so far and sets nothing more: the job goes as the user wrote it. Returns the refused
-- `name=value`, or nil when all were set.
local function apply(options, set)
  local before = {}
  for _, gpu in ipairs({true, false}) do
    for name, value in pairs(set) do
      if (GPU_OPTIONS[name] ~= nil) == gpu then
        local old = options[name]
        if not pcall(function() options[name] = value end) then
          for n, v in pairs(before) do pcall(function() options[n] = v end) end
          return name .. "=" .. value
        end
        if old ~= nil then before[name] = old end
      end
    end
  end
  return nil
end

-- The filter and the deferred steps read the site config named here, and drop the user's own XMEM_* variables
-- (xmem.slurm.contract.drop_user_settings): a user's $XMEM_CONFIG pointing at a FIFO held sbatch for minutes.
local SITE_CONFIG = XMEM_CONFIG ~= "" and (" --config " .. shquote(XMEM_CONFIG)) or ""
local FILTER = shquote(XMEM_PYTHON) .. " -I -m xmem.slurm.filter" .. SITE_CONFIG

-- The site's failure mode when the filter gave no usable answer; the config says, the install-time default
-- stands in if even that fails.
local function failure_mode()
  local p = io.popen("timeout 10 " .. FILTER .. " --failure-mode 2>/dev/null")
  local out = p and p:read("*l") or ""
  if p then p:close() end
  if out == "open" or out == "closed" then return out end
  return FAILURE
end

local function fault(what)
  if failure_mode() == "closed" then
    notice("cannot estimate this job's GPU memory (" .. what .. "); the site requires an estimate, job refused")
    return slurm.ERROR
  end
  keep_for_post_submit("cannot estimate this job's GPU memory (" .. what .. "); submitted unchanged")
  return slurm.SUCCESS
end

-- The filter's reply is one JSON object: {"set": {name: string...}, "message": string|null,
-- "reject": string|null, "fault": string|null, "defer": string|null}, written by Python's json.dumps with
-- ensure_ascii. Strings are decoded exactly (an option value passes unchanged: quotes, backslashes, UTF-8).
local ESCAPES = {['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t"}

local function utf8_char(code)
  if code < 0x80 then return string.char(code) end
  if code < 0x800 then return string.char(0xC0 + math.floor(code / 64), 0x80 + code % 64) end
  if code < 0x10000 then
    return string.char(0xE0 + math.floor(code / 4096), 0x80 + math.floor(code / 64) % 64, 0x80 + code % 64)
  end
  return string.char(0xF0 + math.floor(code / 262144), 0x80 + math.floor(code / 4096) % 64,
                     0x80 + math.floor(code / 64) % 64, 0x80 + code % 64)
end

-- The JSON string whose opening quote is at out[i]: its text and the position after it (nil if malformed).
local function json_string_at(out, i)
  local parts, j = {}, i + 1
  while true do
    local k = string.find(out, '["\\]', j)
    if k == nil then return nil end
    parts[#parts + 1] = string.sub(out, j, k - 1)
    if string.sub(out, k, k) == '"' then return table.concat(parts), k + 1 end
    local e = string.sub(out, k + 1, k + 1)
    if e == "u" then
      local code = tonumber(string.sub(out, k + 2, k + 5), 16)
      if code == nil then return nil end
      local low = string.match(out, "^\\u(%x%x%x%x)", k + 6)
      if code >= 0xD800 and code < 0xDC00 and low then  -- a surrogate pair: one character above U+FFFF
        code = 0x10000 + (code - 0xD800) * 1024 + (tonumber(low, 16) - 0xDC00)
        k = k + 6
      end
      parts[#parts + 1] = utf8_char(code)
      j = k + 6
    elseif ESCAPES[e] then
      parts[#parts + 1] = ESCAPES[e]
      j = k + 2
    else
      return nil
    end
  end
end

-- The reply as a table: string or nil fields, and `set` as a table of strings; nil if it is not a reply.
local function parse_reply(out)
  local reply, i = {}, string.find(out, "{", 1, true)
  if i == nil then return nil end
  local function skip(pattern)
    local _, e = string.find(out, "^%s*" .. pattern, i)
    if e then i = e + 1 end
    return e
  end
  local function object(into)
    while true do
      if skip("}") then return true end
      skip(",")
      if not string.find(out, '^%s*"', i) then return false end
      skip("")
      local key, after = json_string_at(out, i)
      if key == nil then return false end
      i = after
      if not skip(":") then return false end
      if skip("null") then
        into[key] = nil
      elseif skip("{") then
        into[key] = {}
        if not object(into[key]) then return false end
      elseif string.find(out, '^%s*"', i) then
        skip("")
        into[key], i = json_string_at(out, i)
        if into[key] == nil then return false end
      else
        return false
      end
    end
  end
  i = i + 1
  if not object(reply) or type(reply.set) ~= "table" then return nil end
  return reply
end

-- sbatch's own command line has a lone `:` between the components of a heterogeneous job; cli_filter sees
-- one component at a time, so the filter is told (it leaves such jobs alone).
local function hetjob_on_command_line()
  local f = io.open("/proc/self/cmdline", "r")
  if not f then return false end
  local cmdline = f:read("*a") or ""
  f:close()
  return string.find("\0" .. cmdline, "%z:%z") ~= nil
end


function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  -- Only whole jobs from outside an allocation: srun steps inside a job, and later components of a
  -- heterogeneous job, keep what they asked for.
  -- Nor sbatch calls xmem makes itself (deferred mode's estimation jobs).
  if pack_offset ~= 0 or os.getenv("SLURM_JOB_ID") ~= nil or os.getenv("XMEM_NO_FILTER") ~= nil then
    return slurm.SUCCESS
  end
  local argv = options["argv"] or {}
  local script = argv[1]
  if not readable(script) then script = nil end
  if script == nil and options["wrap"] == nil then return slurm.SUCCESS end  -- srun/salloc command, stdin

  -- The request goes through a file the filter deletes as soon as it has read it, the reply through a pipe:
  -- a sbatch killed meanwhile leaves no file behind. The filter watches this sbatch (its pid) and ends, with
  -- its tracer, once nobody waits for the answer.
  local input = os.tmpname()
  local f = io.open(input, "w")
  f:write('{"script":', json_string(script), ',"argv":', json_list(argv),
          ',"options":', slurm.json_cli_options(options) or "{}",
          ',"hetjob":', hetjob_on_command_line() and "true" or "false",
          ',"user":', json_string(os.getenv("USER")), ',"env":', slurm.json_env() or "{}", '}')
  f:close()
  -- The filter's stderr is /dev/null. Only when sbatch's stderr is a terminal does the filter get a copy of it (fd 3,
  -- named by XMEM_PROGRESS_FD), for its progress line during an estimate that is not cached (xmem.slurm.inline).
  local cmd = "p=; if [ -t 2 ]; then exec 3>&2; p=3; fi; XMEM_PROGRESS_FD=$p " ..
              "timeout " .. TIMEOUT_S .. " " .. FILTER .. " --request " .. shquote(input) ..
              (own_pid() and (" --sbatch-pid " .. own_pid()) or "") .. " </dev/null 2>/dev/null; echo \"exit=$?\""
  local p = io.popen(cmd)
  local out = p and p:read("*a") or ""
  if p then p:close() end
  os.remove(input)
  if string.match(out, "exit=124%s*$") then return fault("timed out after " .. TIMEOUT_S .. " s") end

  local reply = parse_reply(out)
  if reply == nil then return fault("xmem-slurm filter gave no answer") end
  if reply.fault ~= nil then return fault(reply.fault) end
  if reply.reject ~= nil then
    notice(reply.reject)
    return slurm.ERROR
  end
  local waits = options["hold"] ~= nil and "hold" or ""  -- read before the reply's own hold is set
  if reply.defer ~= nil and reply.set.hold == nil then waits = "begin" end  -- put off, not held
  local refused = apply(options, reply.set)
  if refused then
    keep_for_post_submit("sbatch refused the request xmem chose (" .. refused .. "); submitted as written")
    return slurm.SUCCESS
  end
  keep_for_post_submit(reply.message, reply.defer, waits)
  return slurm.SUCCESS
end

-- Once Slurm has the job: the user's line, and in deferred mode the estimation job (and the watchdog that
-- releases or cancels the held job if the estimation job dies), queued by the spool's submit.sh, which the filter
-- wrote (no Python starts here, in sbatch's time: xmem.slurm.deferred.submit_script). It exits 0 when queued, 2
-- when it could not queue and has already released (or, fail-closed, cancelled) the job and said why; anything
-- else (a crash, a timeout, a spool that is not one) leaves that to this side, so that no job stays held for xmem.
-- A job put off (xmem.slurm.putoff) is not held: its submit.sh starts the estimate detached, and if that fails
-- Slurm starts the job unchanged at its put-off time. One held for such an estimate (a fail-closed site) is
-- cancelled here when it could not be started, as a deferred one.
function slurm_cli_post_submit(offset, job_id, step_id)
  local stored = offset == 0 and slurm.cli_retrieve(0)
  if not stored then return slurm.SUCCESS end
  local spool, waits, message = string.match(stored, "^([^\n]*)\n(%a*)\n(.*)$")
  if message ~= nil and message ~= "" then notice(message) end
  if spool == nil or spool == "" then return slurm.SUCCESS end
  local job = tostring(job_id)
  local status = 1
  if string.match(spool, "^/[^%c]*/spool/%x+$") and string.match(job, "^%d+$") then
    status = exit_code(os.execute("timeout 60 sh " .. shquote(spool .. "/submit.sh") .. " " .. job .. " >/dev/null"))
  end
  if status == 0 or status == 2 then return slurm.SUCCESS end
  if waits == "begin" then
    notice("the estimate could not be started (exit " .. status .. "): job " .. job ..
           " starts unchanged at its put-off time")
  elseif failure_mode() == "closed" then
    os.execute("timeout 30 scancel " .. job .. " >/dev/null 2>&1")
    notice("the estimate could not be queued (exit " .. status .. "); the site requires one: job " .. job ..
           " cancelled")
  elseif waits ~= "hold" then
    os.execute("timeout 30 scontrol release " .. job .. " >/dev/null 2>&1")
    notice("the estimate could not be queued (exit " .. status .. "): job " .. job .. " released unchanged")
  end
  return slurm.SUCCESS
end
