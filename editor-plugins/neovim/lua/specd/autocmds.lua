--- The autocommands: specd-lsp attaching to and leaving buffers, a fresh status when insert
--- mode ends, and where the cursor came to rest (specd.focus).

local focus = require('specd.focus')
local status = require('specd.status')
local util = require('specd.util')

local M = {}

---@param bufnr integer
---@return string
local function buffer_group(bufnr)
  return 'specd.buffer.' .. bufnr
end

--- Calls `on_attach(client, bufnr)` / `on_detach(client, bufnr)` for specd-lsp clients.
---@param group integer
---@param on_attach fun(client: vim.lsp.Client, bufnr: integer)
---@param on_detach fun(client: vim.lsp.Client, bufnr: integer)
function M.setup(group, on_attach, on_detach)
  for event, handler in pairs({ LspAttach = on_attach, LspDetach = on_detach }) do
    vim.api.nvim_create_autocmd(event, {
      group = group,
      callback = function(args)
        local client = vim.lsp.get_client_by_id(args.data.client_id)
        if client and client.name == util.NAME then
          handler(client, args.buf)
        end
      end,
    })
  end
end

--- specd-lsp notifies status changes at most twice a second; asking when insert mode ends keeps
--- the statusline's latency current without a request per suggestion.
---@param client vim.lsp.Client
---@param bufnr integer
function M.watch_buffer(client, bufnr)
  local group = vim.api.nvim_create_augroup(buffer_group(bufnr), { clear = true })
  vim.api.nvim_create_autocmd('InsertLeave', {
    group = group,
    buffer = bufnr,
    callback = function()
      if not util.is_stopped(client) then
        util.request(client, status.METHOD, vim.empty_dict(), function(_, result, ctx)
          status.on_notification(nil, result, ctx)
        end, bufnr)
      end
    end,
  })
  focus.watch(bufnr, group)
end

---@param bufnr integer
function M.forget_buffer(bufnr)
  pcall(vim.api.nvim_del_augroup_by_name, buffer_group(bufnr))
  focus.forget(bufnr)
end

return M
