--- The :Specd command's actions, and :SpecdStatus.

local status = require('specd.status')
local util = require('specd.util')

local M = {}

--- Asks specd-lsp for its status and shows it.
---@param enabled boolean whether suggestions are on in this Neovim
function M.show_status(enabled)
  local client = util.clients(0)[1] or util.clients()[1]
  if not client then
    vim.notify('specd: specd-lsp is not attached (was setup() called, is the filetype covered?)', vim.log.levels.WARN)
    return
  end
  util.request(client, status.METHOD, vim.empty_dict(), function(err, result)
    if err or type(result) ~= 'table' then
      vim.notify('specd: status failed: ' .. (err and err.message or 'no answer'), vim.log.levels.ERROR)
      return
    end
    vim.notify(table.concat(status.report(result, enabled), '\n'))
  end)
end

local function specd()
  return require('specd')
end

M.actions = {
  status = function()
    specd().show_status()
  end,
  toggle = function()
    specd().toggle()
  end,
  enable = function()
    specd().set_enabled(true)
  end,
  disable = function()
    specd().set_enabled(false)
  end,
  restart = function()
    specd().restart()
  end,
  log = function()
    vim.cmd.tabnew(vim.lsp.get_log_path())
  end,
  health = function()
    vim.cmd.checkhealth('specd')
  end,
}

--- :Specd <action> (default: status)
---@param args string[]
function M.run(args)
  local action = M.actions[args[1] or 'status']
  if not action then
    vim.notify(('specd: unknown action %q (%s)'):format(args[1], table.concat(vim.tbl_keys(M.actions), ', ')), vim.log.levels.ERROR)
    return
  end
  action()
end

return M
