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
local XMEM_CONFIG = "@XMEM_CONFIG@"    -- site config used when the user has no $XMEM_CONFIG ("" = xmem's default)
local TIMEOUT_S = "@TIMEOUT_S@"        -- outer limit in seconds; the estimate's own limit is in the config
local FAILURE = "@FAILURE@"            -- "open" or "closed", used only when xmem-slurm cannot even say

local function notice(msg)
  io.stderr:write("xmem-slurm: " .. msg .. "\n")
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

local FILTER = shquote(XMEM_PYTHON) .. " -I -m xmem.slurm.filter"
local DEFERRED = shquote(XMEM_PYTHON) .. " -I -m xmem.slurm.deferred"

local function command_prefix()
  local cfg = os.getenv("XMEM_CONFIG")
  if (cfg == nil or cfg == "") and XMEM_CONFIG ~= "" then
    return "XMEM_CONFIG=" .. shquote(XMEM_CONFIG) .. " "
  end
  return ""
end

-- The site's failure mode when the filter gave no usable answer; the config says, the install-time default
-- stands in if even that fails.
local function failure_mode()
  local p = io.popen(command_prefix() .. "timeout 10 " .. FILTER .. " --failure-mode 2>/dev/null")
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
  notice("cannot estimate this job's GPU memory (" .. what .. "); submitted unchanged")
  return slurm.SUCCESS
end

-- The filter's reply is one JSON object: {"set": {name: string...}, "message": string|null,
-- "reject": string|null, "fault": string|null, "defer": string|null}. It is read with patterns, not a JSON
-- library, so the values must be plain strings (the Python side guarantees it: no quotes or backslashes).
local function reply_field(out, name)
  return string.match(out, '"' .. name .. '"%s*:%s*"([^"\\]*)"')
end

local function reply_set(out)
  local body = string.match(out, '"set"%s*:%s*(%b{})')
  if body == nil then return nil end
  local set = {}
  for k, v in string.gmatch(body, '"([%w_-]+)"%s*:%s*"([^"\\]*)"') do set[k] = v end
  return set
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

  local input = os.tmpname()
  local output = os.tmpname()
  local f = io.open(input, "w")
  f:write('{"script":', json_string(script), ',"argv":', json_list(argv),
          ',"options":', slurm.json_cli_options(options) or "{}",
          ',"user":', json_string(os.getenv("USER")), ',"env":', slurm.json_env() or "{}", '}')
  f:close()
  local cmd = command_prefix() .. "timeout " .. TIMEOUT_S .. " " .. FILTER ..
              " < " .. shquote(input) .. " > " .. shquote(output) .. " 2>/dev/null"
  local ok, how, code = os.execute(cmd)
  local rf = io.open(output, "r")
  local out = rf and rf:read("*a") or ""
  if rf then rf:close() end
  os.remove(input); os.remove(output)
  -- Lua 5.1's os.execute returns the wait status; `timeout` exits 124 on expiry.
  local status = type(ok) == "number" and ok or code
  if status == 124 or status == 124 * 256 then return fault("timed out after " .. TIMEOUT_S .. " s") end

  local set = reply_set(out)
  if set == nil then return fault("xmem-slurm filter gave no answer") end
  local why = reply_field(out, "fault")
  if why ~= nil then return fault(why) end
  local message = reply_field(out, "message")
  local reject = reply_field(out, "reject")
  if reject ~= nil then
    notice(reject)
    return slurm.ERROR
  end
  for name, value in pairs(set) do options[name] = value end
  if message ~= nil and message ~= "" then notice(message) end
  local token = reply_field(out, "defer")
  if token ~= nil and string.match(token, "^%x+$") then slurm.cli_store(0, token) end
  return slurm.SUCCESS
end

-- Deferred mode: the job is held; now that it has an id, queue its estimation job (and the watchdog that
-- releases or cancels it if the estimation job dies). Failures are handled, and reported, by that command.
function slurm_cli_post_submit(offset, job_id, step_id)
  local token = slurm.cli_retrieve(0)
  if offset == 0 and token ~= nil and string.match(token, "^%x+$") then
    os.execute(command_prefix() .. "timeout 60 " .. DEFERRED .. " submit " .. token .. " " ..
               tostring(job_id) .. " >/dev/null")
  end
  return slurm.SUCCESS
end
