--- A child Neovim driven over RPC, as a user would drive it: real insert mode, autocmds, keys.

---@class specd.test.Child
---@field job integer
local Child = {}
Child.__index = Child

-- The Neovim under test: this one, or SPECD_TEST_CHILD_NVIM (e.g. a 0.10 to try the plugin renderer there).
Child.NVIM = os.getenv('SPECD_TEST_CHILD_NVIM') or vim.v.progpath

--- Starts `nvim --embed --headless --clean` with the plugin on 'runtimepath'.
---@param plugin_dir string
---@param cwd string
---@return specd.test.Child
function Child.new(plugin_dir, cwd)
  local job = vim.fn.jobstart({
    Child.NVIM, '--embed', '--headless', '--clean', '-n', '-i', 'NONE',
    '--cmd', 'set runtimepath^=' .. vim.fn.fnameescape(plugin_dir),
  }, { rpc = true, cwd = cwd })
  assert(job > 0, 'could not start a child nvim')
  return setmetatable({ job = job }, Child)
end

--- Runs Lua in the child; `...` arrive there as `...`.
function Child:lua(code, ...)
  return vim.rpcrequest(self.job, 'nvim_exec_lua', code, { ... })
end

--- Types keys into the child (nvim_input: as if typed, mappings apply).
---@param keys string
function Child:input(keys)
  vim.rpcrequest(self.job, 'nvim_input', keys)
end

function Child:cmd(command)
  return vim.rpcrequest(self.job, 'nvim_command', command)
end

--- Polls a Lua condition in the child until it returns a truthy value; fails after `timeout_ms`.
---@param what string
---@param timeout_ms integer
---@param code string
function Child:wait(what, timeout_ms, code, ...)
  local deadline = vim.uv.hrtime() + timeout_ms * 1e6
  local last
  repeat
    last = self:lua(code, ...)
    if last and last ~= vim.NIL then
      return last
    end
    vim.wait(20)
  until vim.uv.hrtime() > deadline
  error(('timed out after %d ms waiting for %s (last: %s)'):format(timeout_ms, what, vim.inspect(last)), 2)
end

function Child:stop()
  pcall(vim.rpcnotify, self.job, 'nvim_command', 'qall!')
  if vim.fn.jobwait({ self.job }, 5000)[1] == -1 then
    vim.fn.jobstop(self.job)
  end
end

return Child
