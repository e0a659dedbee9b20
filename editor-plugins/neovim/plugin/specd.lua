-- specd.nvim commands. Nothing starts until require('specd').setup() is called.
if vim.g.loaded_specd then
  return
end
vim.g.loaded_specd = true

vim.api.nvim_create_user_command('Specd', function(args)
  require('specd').command(args.fargs)
end, {
  nargs = '?',
  desc = 'specd: status | toggle | enable | disable | restart | log | health',
  complete = function(lead)
    local names = vim.tbl_keys(require('specd.commands').actions)
    table.sort(names)
    return vim.tbl_filter(function(name)
      return vim.startswith(name, lead)
    end, names)
  end,
})

vim.api.nvim_create_user_command('SpecdStatus', function()
  require('specd').show_status()
end, { desc = 'specd: show the language server and daemon status' })

vim.api.nvim_create_user_command('SpecdToggle', function()
  require('specd').toggle()
end, { desc = 'specd: turn suggestions on or off' })
