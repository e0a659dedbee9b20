--- Taking a suggestion, all of it or its next line or word, then telling specd-lsp through the
--- item's command: the whole item counts as accepted (and specd-lsp prefetches what follows),
--- a part as a partial accept. Shared by both renderers.

local text = require('specd.text')
local util = require('specd.util')

local M = {}

--- The item's command for a part of it: the same command with { partialChars = n }.
---@param command lsp.Command
---@param piece string
---@return lsp.Command
function M.partial_command(command, piece)
  local arguments = { (command.arguments or {})[1], { partialChars = vim.fn.strchars(piece) } }
  return { title = command.title, command = command.command, arguments = arguments }
end

--- Inserts the whole item or its next line or word (text.apply), then runs the matching command.
---@param bufnr integer
---@param item specd.Item
---@param kind 'all'|'line'|'word'
function M.take(bufnr, item, kind)
  local whole, piece = text.apply(bufnr, item, kind)
  local client = item.command and vim.lsp.get_client_by_id(item.client_id)
  if not client then
    return
  end
  util.exec_cmd(client, whole and item.command or M.partial_command(item.command, piece), bufnr)
end

return M
