--- :checkhealth specd — Neovim version, the specd-lsp binary, the daemon, the model.
--- Every wait is bounded by `health_timeout_ms` (default 5 s).

local status = require('specd.status')
local util = require('specd.util')

local M = {}

local health = vim.health

---@param config specd.Config
local function check_neovim(config)
  health.start('specd: Neovim')
  local v = vim.version()
  local version = ('%d.%d.%d'):format(v.major, v.minor, v.patch)
  if vim.fn.has('nvim-0.10') == 0 then
    health.error(('Neovim %s is too old: specd.nvim needs 0.10 or newer'):format(version))
  elseif vim.fn.has('nvim-0.12') == 1 and vim.lsp.inline_completion then
    health.ok(('Neovim %s: vim.lsp.inline_completion available'):format(version))
  else
    health.ok(('Neovim %s: suggestions drawn by specd.nvim (0.12 adds vim.lsp.inline_completion)'):format(version))
  end
  local specd = require('specd')
  if specd.config() then
    local renderer, reason = specd.renderer()
    health.ok(('setup() called; renderer: %s (%s); suggestions %s'):format(renderer, reason, specd.is_enabled() and 'on' or 'off'))
    if renderer == 'native' and require('specd.renderer').native_support() == 'all-buffers' then
      health.warn('specd.nvim patches vim.lsp.inline_completion here (its triggers made buffer-local)',
        { 'a newer Neovim 0.12 build fixes it', "renderer = 'auto' uses specd.nvim's own renderer instead" })
    end
  else
    health.warn('setup() has not been called', { "add require('specd').setup() to your config (lazy.nvim: opts = {})" })
  end
  return config
end

---@param config specd.Config
---@return boolean found
local function check_binary(config)
  health.start('specd: language server')
  local path = vim.fn.exepath(config.cmd[1])
  if path == '' then
    health.error(('`%s` not found'):format(config.cmd[1]), {
      'install specd (pip install specd) so specd-lsp is on PATH',
      "or point cmd at it: require('specd').setup({ cmd = { '/path/to/specd-lsp' } })",
    })
    return false
  end
  local ok, result = pcall(function()
    return vim.system({ path, '--version' }, { text = true }):wait(config.health_timeout_ms)
  end)
  if ok and result.code == 0 then
    health.ok(('%s (%s)'):format(vim.trim(result.stdout), path))
  else
    health.warn(('%s found but `--version` failed: %s'):format(path, ok and (result.stderr or result.code) or result))
  end
  return true
end

--- The daemon's socket path as specd's own config finds it by default.
---@param config specd.Config
---@return string
function M.socket_path(config)
  local daemon = type(config.settings.daemon) == 'table' and config.settings.daemon or {}
  if type(daemon.socket) == 'string' and daemon.socket ~= '' then
    return vim.fs.normalize(daemon.socket)
  end
  if vim.env.SPECD_DAEMON_SOCKET and vim.env.SPECD_DAEMON_SOCKET ~= '' then
    return vim.env.SPECD_DAEMON_SOCKET
  end
  if vim.env.XDG_RUNTIME_DIR and vim.env.XDG_RUNTIME_DIR ~= '' then
    return vim.env.XDG_RUNTIME_DIR .. '/specd/specd.sock'
  end
  local state_home = vim.env.XDG_STATE_HOME or (vim.env.HOME .. '/.local/state')
  return state_home .. '/specd/run/specd.sock'
end

--- One msgpack-rpc `status` request to the daemon's socket, bounded by `timeout_ms`.
---@param path string
---@param timeout_ms integer
---@return table? status, string? err
function M.daemon_status(path, timeout_ms)
  local pipe = vim.uv.new_pipe(false)
  local done, answer, failure = false, nil, nil
  local received = ''
  pipe:connect(path, function(connect_err)
    if connect_err then
      done, failure = true, connect_err
      return
    end
    pipe:read_start(function(read_err, chunk)
      if read_err or not chunk then
        done, failure = true, read_err or 'the daemon closed the connection'
        return
      end
      received = received .. chunk
      local ok, message = pcall(vim.mpack.decode, received) -- fails until the whole answer is in
      if ok and type(message) == 'table' and message[1] == 1 then
        done, answer = true, message
      end
    end)
    pipe:write(vim.mpack.encode({ 0, 1, 'status', { vim.empty_dict() } }))
  end)
  vim.wait(timeout_ms, function()
    return done
  end, 20)
  pipe:close()
  if not done then
    return nil, ('no answer within %d ms'):format(timeout_ms)
  end
  if failure then
    return nil, tostring(failure)
  end
  local err, result = answer[3], answer[4]
  if err ~= nil and err ~= vim.NIL then
    return nil, type(err) == 'table' and tostring(err.message) or tostring(err)
  end
  return result
end

--- The daemon's state through the attached specd-lsp, waiting (bounded) while it connects or loads.
---@param client vim.lsp.Client
---@param timeout_ms integer
---@return table? daemon, string? err
local function daemon_via_client(client, timeout_ms)
  local deadline = vim.uv.now() + timeout_ms
  local last, err
  repeat
    last, err = status.fetch(client, math.max(deadline - vim.uv.now(), 1))
    local state = last and last.state
    if state == 'ready' or state == 'unavailable' or state == 'stopped' then
      break
    end
    vim.wait(50)
  until vim.uv.now() >= deadline
  if not last then
    return nil, err
  end
  if last.state ~= 'ready' then
    return nil, ('specd-lsp reports the daemon %s%s'):format(last.state or '?', last.message and (': ' .. last.message) or '')
  end
  local daemon = last.daemon or {}
  return { pid = daemon.pid, version = daemon.version, state = daemon.state, models = daemon.models, via = 'specd-lsp' }
end

---@param config specd.Config
---@return table? daemon
local function check_daemon(config)
  health.start('specd: daemon')
  local client = util.clients(0)[1] or util.clients()[1]
  local daemon, err
  if client then
    daemon, err = daemon_via_client(client, config.health_timeout_ms)
  else
    local path = M.socket_path(config)
    daemon, err = M.daemon_status(path, config.health_timeout_ms)
    if daemon then
      daemon.via = path
    else
      err = ('%s: %s'):format(path, err)
    end
  end
  if not daemon then
    health.error('daemon not reachable: ' .. tostring(err), {
      'start it with `specd serve` (or `specd install-service` for systemd)',
      'specd-lsp starts one itself unless settings.daemon.spawn is false',
    })
    return nil
  end
  health.ok(('daemon pid %s, specd %s (via %s)'):format(daemon.pid or '?', daemon.version or '?', daemon.via))
  return daemon
end

---@param daemon table
local function check_model(daemon)
  health.start('specd: model')
  local models = type(daemon.models) == 'table' and daemon.models or {}
  local names = ('%s%s'):format(models.target or '?', models.draft and models.draft ~= vim.NIL and (' + draft ' .. models.draft) or '')
  if daemon.state == 'ready' then
    health.ok(('loaded: %s%s'):format(names, models.device and (' on ' .. models.device) or ''))
  elseif daemon.state == 'unloaded' then
    health.ok(('%s: unloaded after idle time; loads again on the next completion'):format(names))
  elseif daemon.state == 'loading' then
    health.warn(('%s: still loading'):format(names), { 'large models take a while on first start; check again' })
  else
    health.error(('%s: state %s'):format(names, tostring(daemon.state)), { 'see `specd status` and the daemon log' })
  end
end

function M.check()
  local config = require('specd').config() or require('specd.config').resolve()
  check_neovim(config)
  if not check_binary(config) then
    return
  end
  local daemon = check_daemon(config)
  if daemon then
    check_model(daemon)
  end
end

return M
